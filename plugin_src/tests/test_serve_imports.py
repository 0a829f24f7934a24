"""`serve` imports only what serving needs (memory: bench/RESULTS.md), and `healthcheck` is cheap."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from rdma_device_plugin import cli
{extra}
print(json.dumps(sorted(sys.modules)))
"""


def _modules(extra: str = "") -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(extra=extra)], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout))


def test_serve_path_leaves_out_the_simulator_fixtures_pyverbs_and_metrics() -> None:
    mods = _modules("from rdma_device_plugin import supervisor")
    unwanted = {m for m in mods if m.split(".")[0] == "rdma_kubesim" or m == "rdma_device_plugin.metrics"}
    unwanted |= {m for m in mods if m in ("rdma_node.fixtures", "pyverbs", "prometheus_client")}
    assert "rdma_node.sysfs" in mods  # the test looks at the right names
    assert not unwanted
    assert "yaml" not in mods, "YAML is read only when there is a config file"


def test_plain_metrics_load_no_api_client_nor_certificate() -> None:
    """Metrics without --metrics-auth/--metrics-tls-*: neither the auth module nor the API client."""
    args = "cli.build_parser().parse_args(['serve', '--metrics-address', '127.0.0.1:1'])"
    mods = _modules(f"from rdma_device_plugin import metrics, metricsserver; metricsserver.auth_of({args})")
    assert "rdma_device_plugin.metrics" in mods
    assert not {"rdma_device_plugin.metricsauth", "rdma_device_plugin.dra.kubeapi"} & mods


def test_healthcheck_imports_neither_grpc_nor_pydantic() -> None:
    mods = _modules("cli.build_parser().parse_args(['healthcheck']); from rdma_device_plugin import supervision")
    assert not {m for m in mods if m.split(".")[0] in ("grpc", "pydantic", "google", "yaml")}
    assert "importlib.metadata" not in mods, "the version is read only for --version"


def test_serve_maps_no_openssl(sim, start_plugin) -> None:  # type: ignore[no-untyped-def]
    """`serve` never uses Python's OpenSSL bindings (gRPC's TLS is in its C core, sockets are
    unix): loading libcrypto through pydantic -> secrets -> hmac -> _hashlib cost 3.6 MiB."""
    plugin = start_plugin()
    assert sim.wait_registered("rdma/hca"), plugin.output()
    with open(f"/proc/{plugin.proc.pid}/maps", encoding="utf-8") as fh:
        maps = fh.read()
    assert "libcrypto" not in maps and "libssl" not in maps
    assert "Traceback" not in plugin.output()
