"""The ``dra`` sub-command's flags (standard library only: building the CLI parser imports this)."""

from __future__ import annotations

import argparse
import os

from ..metricsflags import add_arguments as add_metrics_auth

DEFAULT_DRIVER = "rdma.lingjun.io"
DEFAULT_HEALTH_FILE = "/dev/shm/rdma-dra-driver.health"


def add_arguments(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--config", default=env("RDMA_DP_CONFIG"), help="config file (YAML, version v1), as for serve")
    p.add_argument("--node-name", default=env("NODE_NAME", ""), help="this node's name (env NODE_NAME)")
    p.add_argument(
        "--kubeconfig", default=env("KUBECONFIG", ""), help="kubeconfig (default: the pod's service account)"
    )
    p.add_argument(
        "--driver-name", default=env("RDMA_DRA_DRIVER_NAME", DEFAULT_DRIVER), help=f"default {DEFAULT_DRIVER}"
    )
    p.add_argument(
        "--kubelet-dir",
        default=env("RDMA_DRA_KUBELET_DIR", "/var/lib/kubelet"),
        help="the kubelet's root dir: plugins_registry/ and plugins/<driver>/ are below it",
    )
    p.add_argument(
        "--instance-uid",
        default=env("POD_UID", ""),
        help="names this instance's sockets (env POD_UID: the chart sets the pod's UID; default: a random one)",
    )
    p.add_argument(
        "--handover-seconds",
        type=float,
        default=float(env("RDMA_DRA_HANDOVER_SECONDS", "0")),
        help="on SIGTERM, serve on until a newer instance on the node is registered, at most this long "
        "(the chart: 20; 0: stop at once)",
    )
    p.add_argument(
        "--cdi-dir", default=env("RDMA_DP_CDI_DIR", "/var/run/cdi"), help="CDI spec dir (default /var/run/cdi)"
    )
    p.add_argument(
        "--state-dir",
        default=env("RDMA_DRA_STATE_DIR", ""),
        help="prepared claims (default <kubelet-dir>/plugins/<driver>)",
    )
    p.add_argument(
        "--metrics-address",
        default=env("RDMA_DRA_METRICS_ADDRESS", ""),
        help="serve Prometheus metrics on HOST:PORT (e.g. [$(POD_IP)]:9410; empty: off)",
    )
    add_metrics_auth(p, lambda name, default: env(f"RDMA_DRA_{name}", default))
    p.add_argument(
        "--health-file",
        default=env("RDMA_DRA_HEALTH_FILE", DEFAULT_HEALTH_FILE),
        help=f"liveness file read by `healthcheck --health-file` (default {DEFAULT_HEALTH_FILE}; empty: none)",
    )
