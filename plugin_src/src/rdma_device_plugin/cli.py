"""Entry point: flags, config, and the sub-commands (serve is the default)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

LOG = logging.getLogger("rdma_device_plugin")

DEFAULT_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
from . import metricsflags  # noqa: E402 - standard library only, cheap
from .supervision import DEFAULT_HEALTH_FILE  # noqa: E402 - standard library only, cheap


def _env(name: str, default: str) -> str:
    """Flag defaults can come from the environment (flag > env > built-in), as the chart sets them."""
    return os.environ.get(f"RDMA_DP_{name}", default)


def _add_roots(p: argparse.ArgumentParser, proc: bool = False) -> None:
    p.add_argument("--sysfs-root", default=_env("SYSFS_ROOT", "/sys"), help="sysfs root (default /sys)")
    p.add_argument(
        "--dev-root",
        default=_env("DEV_ROOT", "/dev"),
        help='dev root (default /dev); "" reads char-device presence from sysfs, so no host /dev is needed',
    )
    if proc:
        p.add_argument("--procfs-root", default=_env("PROCFS_ROOT", "/proc"), help="procfs root (default /proc)")


def _add_logging(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "info"), choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default=_env("LOG_FORMAT", "text"), choices=["text", "json"])


class _Version(argparse.Action):
    """--version without paying for importlib.metadata unless asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        from . import __version__

        print(f"rdma-device-plugin {__version__}")  # stdout, as argparse's own version action does
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdma-device-plugin",
        description="Kubernetes device plugin for RDMA NICs (shared and exclusive mode).",
    )
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command")

    serve = sub.add_parser("serve", help="serve the kubelet (default)")
    serve.add_argument("--config", default=os.environ.get("RDMA_DP_CONFIG"), help="config file (YAML, version v1)")
    _add_roots(serve, proc=True)
    serve.add_argument(
        "--device-plugin-dir",
        default=_env("DEVICE_PLUGIN_DIR", DEFAULT_DEVICE_PLUGIN_DIR),
        help=f"kubelet device-plugin dir (default {DEFAULT_DEVICE_PLUGIN_DIR})",
    )
    serve.add_argument("--cdi-dir", default=_env("CDI_DIR", "/var/run/cdi"), help="CDI spec dir (default /var/run/cdi)")
    serve.add_argument(
        "--metrics-address",
        default=_env("METRICS_ADDRESS", ""),
        help="serve Prometheus metrics on HOST:PORT (off when empty, the default)",
    )
    metricsflags.add_arguments(serve, _env)
    serve.add_argument(
        "--kubeconfig",
        default=_env("KUBECONFIG", ""),
        help="API server credentials for --metrics-auth kubernetes only (default: the pod's service account)",
    )
    serve.add_argument(
        "--status-file",
        default=_env("STATUS_FILE", ""),
        help="status file for `rdma-device-plugin status` (default <device-plugin-dir>/rdma-device-plugin/status.json)",
    )
    serve.add_argument(
        "--health-file",
        default=_env("HEALTH_FILE", DEFAULT_HEALTH_FILE),
        help=f"liveness heartbeat file read by `healthcheck` (default {DEFAULT_HEALTH_FILE}; empty: none)",
    )
    serve.add_argument(
        "--nfd-features-file",
        default=_env("NFD_FEATURES_FILE", ""),
        help="write the node's RDMA facts as a Node Feature Discovery local feature file here "
        "(e.g. /etc/kubernetes/node-feature-discovery/features.d/rdma-device-plugin; off when empty)",
    )
    serve.add_argument(
        "--verbs-dev-dir",
        default=_env("VERBS_DEV_DIR", "/dev/infiniband"),
        help="this process's own /dev/infiniband: pyverbs is used only when it holds usable uverbs devices",
    )
    _add_logging(serve)

    st = sub.add_parser("status", help="print this node's mode, resources, NICs with health and why, last allocations")
    st.add_argument(
        "--device-plugin-dir",
        default=_env("DEVICE_PLUGIN_DIR", DEFAULT_DEVICE_PLUGIN_DIR),
        help="the plugin's --device-plugin-dir (its status file is there)",
    )
    st.add_argument("--status-file", default=_env("STATUS_FILE", ""), help="read this status file instead")
    st.add_argument("--output", "-o", choices=["text", "json"], default="text")

    hc = sub.add_parser("healthcheck", help="exit 0 when the serving process is live (the chart's livenessProbe)")
    hc.add_argument("--health-file", default=_env("HEALTH_FILE", DEFAULT_HEALTH_FILE), help="the file `serve` writes")
    hc.add_argument(
        "--ready",
        action="store_true",
        help="exit 0 only when also every resource is registered with the kubelet, its stream open "
        "(the chart's readinessProbe)",
    )

    disc = sub.add_parser("discover", help="print the RDMA NICs found and which resource selects them")
    disc.add_argument("--config", default=None, help="config file whose selectors to apply")
    _add_roots(disc)
    disc.add_argument("--output", "-o", choices=["table", "json"], default="table")
    _add_logging(disc)

    fx = sub.add_parser("fixture", help="write a kernel-shaped fixture node (for tests and demos)")
    fx.add_argument("root", help="directory to write (replaced if it exists); holds sys/, proc/, dev/")
    fx.add_argument("--spec", help="node spec file (JSON or YAML); overrides the preset flags")
    fx.add_argument("--nics", type=int, default=4)
    fx.add_argument("--no-bond", action="store_true", help="plain ports instead of RoCE LAG bonds")
    fx.add_argument("--numa-nodes", type=int, default=2)
    fx.add_argument("--link-layer", choices=["Ethernet", "InfiniBand"], default="Ethernet")
    fx.add_argument("--port-state", default="ACTIVE")
    fx.add_argument("--no-ipv6", action="store_true")
    fx.add_argument("--extra-non-mellanox", action="store_true", help="add an Intel irdma NIC")
    fx.add_argument("--gpus-per-nic", type=int, default=2, help="NVIDIA GPUs under each NIC's PCIe switch")
    _add_logging(fx)

    sub.add_parser("config-schema", help="print the config file's JSON schema")

    from .dra.args import add_arguments as add_dra_arguments  # standard library only

    dra = sub.add_parser("dra", help="serve the same NICs as a DRA driver (ResourceSlices, kubelet DRA plugin)")
    add_dra_arguments(dra)
    _add_roots(dra, proc=True)
    _add_logging(dra)
    return parser


def _healthcheck(args: argparse.Namespace) -> int:
    from .supervision import check_health, check_ready

    problems = (check_ready if args.ready else check_health)(args.health_file)
    for problem in problems:
        print(f"rdma-device-plugin: not {'ready' if args.ready else 'live'}: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _discover(args: argparse.Namespace) -> int:
    from rdma_node import sysfs
    from rdma_node.selectors import Selectors

    from .config import load_config

    config = load_config(args.config)
    nics = sysfs.read_nics(args.sysfs_root, args.dev_root)
    owner: dict[str, str] = {}
    for res in config.resources:
        for nic in Selectors.of(res.selectors).select(nics):
            owner.setdefault(nic.name, res.name)
    if args.output == "json":
        out = [dict(nic.to_dict(), resource=owner.get(nic.name)) for nic in nics]
        print(json.dumps({"nics": out, "rdma_cm": sysfs.rdma_cm(args.dev_root, args.sysfs_root).present}, indent=2))
        return 0
    header = ("RDMA DEVICE", "PCI", "VENDOR:DEVICE", "DRIVER", "NUMA", "NETDEVS", "PORTS", "LINK", "UVERBS", "RESOURCE")
    rows = [header]
    for nic in nics:
        rows.append(
            (
                nic.name,
                nic.pci_address,
                f"{nic.vendor}:{nic.device_id}",
                nic.driver or "-",
                "-" if nic.numa_node is None else str(nic.numa_node),
                ",".join(nic.netdevs) or "-",
                ",".join(f"{p.number}:{p.state}" for p in nic.ports) or "-",
                ",".join(nic.link_layers) or "-",
                nic.uverbs.name if nic.uverbs else "-",
                owner.get(nic.name, "-"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(col.ljust(w) for col, w in zip(row, widths, strict=True)).rstrip())
    if not nics:
        print(f"(no RDMA devices under {args.sysfs_root}/class/infiniband)")
    return 0


def _fixture(args: argparse.Namespace) -> int:
    from rdma_node import fixtures

    if args.spec:
        import yaml

        with open(args.spec, encoding="utf-8") as fh:
            spec = fixtures.NodeSpec.from_dict(yaml.safe_load(fh))
    else:
        spec = fixtures.lingjun_node(
            nics=args.nics,
            bond=not args.no_bond,
            numa_nodes=args.numa_nodes,
            link_layer=args.link_layer,
            ipv6=not args.no_ipv6,
            port_state=args.port_state,
            extra_non_mellanox=args.extra_non_mellanox,
            gpus_per_nic=args.gpus_per_nic,
        )
    node = fixtures.write_node(args.root, spec)
    print(json.dumps({"root": node.root, "sysfs": node.sysfs, "procfs": node.procfs, "dev": node.dev}))
    return 0


def _status(args: argparse.Namespace) -> int:
    from .status import default_status_file, render

    path = args.status_file or default_status_file(args.device_plugin_dir)
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        print(
            f"rdma-device-plugin: no status file {path}: the plugin is not running there "
            "(give the plugin's --device-plugin-dir or --status-file)",
            file=sys.stderr,
        )
        return 1
    print(json.dumps(doc, indent=2) if args.output == "json" else render(doc))
    return 0


def leave_out_openssl(metrics: bool) -> None:
    """Keep Python's OpenSSL bindings out of ``serve``, which never uses them (issue 11, memory).

    Must run before pydantic and grpc are imported; ``None`` in ``sys.modules`` makes an import
    raise ImportError, which both modules below handle as "not available":
    - ``_hashlib``: pydantic.types imports secrets -> hmac -> hashlib, and hmac/hashlib load
      libcrypto through ``_hashlib`` (about 3.6 MiB of RSS) for one constant-time compare used
      only by pydantic's Secret types. Without it they use CPython's built-in hashes and
      ``_operator._compare_digest``.
    - ``ssl``: asyncio (which grpc imports) imports it for TLS transports this process never
      uses (unix sockets; grpc's TLS lives in its C core): about 1.2 MiB. prometheus_client
      needs it, hence only without metrics.
    """
    sys.modules.setdefault("_hashlib", None)  # type: ignore[arg-type]
    if not metrics:
        sys.modules.setdefault("ssl", None)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["serve", *argv]
    args = parser.parse_args(argv)
    config_check = None
    if args.command == "dra":
        from .config_view import ConfigCheck

        config_check = ConfigCheck(args.config)  # validated beside the driver's imports (gRPC, OpenSSL)
    if args.command == "healthcheck":  # cheap: the liveness probe runs it every few seconds
        return _healthcheck(args)
    if args.command == "serve":
        leave_out_openssl(metrics=bool(args.metrics_address))
    from .config_base import ConfigError  # the DRA driver never loads the schema (pydantic): config_view

    if args.command == "config-schema":
        from .config import config_json_schema

        print(json.dumps(config_json_schema(), indent=2))
        return 0
    if args.command == "status":
        return _status(args)
    from .logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    if args.command == "serve":
        from .logs import route_native_stderr

        route_native_stderr()  # before grpc loads: its core logs through ours
    try:
        if args.command == "discover":
            return _discover(args)
        if args.command == "fixture":
            return _fixture(args)
        if args.command == "dra":
            from .dra.driver import run

            return run(args, config_check)
        from .supervisor import serve

        return serve(args)
    except ConfigError as exc:
        LOG.error("%s", exc)
        print(f"rdma-device-plugin: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad fixture spec and the like
        print(f"rdma-device-plugin: {exc}", file=sys.stderr)
        return 2
