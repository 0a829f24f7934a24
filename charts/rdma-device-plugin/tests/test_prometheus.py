"""A real Prometheus (Debian's prometheus, 127.0.0.1, 1 s scrapes, its own data dir and port)
scrapes, as the chart's PodMonitor does (HTTPS, the scraper's token reviewed by the session's real
API server: metrics.auth), the real plugin serving a fixture node to the kubelet simulator, and a kube-state-metrics
stand-in (prometheus_client serving kube_node_labels and kube_node_status_capacity as
kube-state-metrics names them, for the fixture node and one RDMA node that runs no plugin): every
dashboard panel's query returns data before any Allocate, the alerts that see absence fire for the
node without a plugin, and a port put DOWN fires the matching alerts (short `for`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import manifests, one

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rdma_kubesim import KubeletSimulator
from rdma_node import fixtures

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
from kube_pytest import Kube  # noqa: E402
from prometheus_local import Prometheus, chart_for_keys, free_port  # noqa: E402

pytest_plugins = ["kube_pytest"]  # the session's control plane: it reviews the scrapers' tokens

RES = "rdma/hca"
JOB = "rdma-rdma-device-plugin-metrics"
NODE = "fixture-node"
MISSING = "gpu-no-plugin"  # an RDMA node (NFD label) whose plugin never came: a mode-label typo
WAIT = 120.0  # generous: a loaded 2-core machine


class KubeStateMetrics(Collector):
    """The two kube-state-metrics families the alerts read, labelled as kube-state-metrics does
    (kube_node_labels with --metric-labels-allowlist; the resource name sanitized, unit integer).
    A stand-in: the real one reads the API server, which this machine does not have."""

    def collect(self):  # type: ignore[no-untyped-def]
        labels = GaugeMetricFamily(
            "kube_node_labels", "Kubernetes labels converted to Prometheus labels.",
            labels=["node", "label_feature_node_kubernetes_io_pci_15b3_present", "label_rdma_lingjun_io_mode"],
        )  # fmt: skip
        labels.add_metric([NODE, "true", ""], 1)
        labels.add_metric([MISSING, "true", "exclsuive"], 1)
        labels.add_metric(["cpu-node", "", ""], 1)
        yield labels
        capacity = GaugeMetricFamily("kube_node_status_capacity", "The capacity for different resources of a node.",
                                     labels=["node", "resource", "unit"])
        capacity.add_metric([NODE, "rdma_hca", "integer"], 1000)
        yield capacity


def wait_for(check: Callable[[], Any], timeout: float = WAIT, every: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every)


AUTH_RELEASE = "pm"  # apart from the releases test_real_cluster.py installs


@pytest.fixture
def metrics_auth(kube: Kube, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The chart's metrics.auth objects (release pm, with the PodMonitor's scraper) in the session's API
    server: the plugin's flags and files as its pod gets them (the serving certificate, a token of its
    ServiceAccount in a kubeconfig) and the scrape config the PodMonitor gives Prometheus (HTTPS
    verified with the chart's CA and server name, the scraper's token the API server filled in)."""
    import base64

    from conftest import NAMESPACE, parse, render_raw

    objs = parse(render_raw({"metrics": {"enabled": True, "serviceMonitor": {"enabled": True}}}, name=AUTH_RELEASE))
    tls = next(o for o in objs if o["kind"] == "Secret" and o["type"] == "kubernetes.io/tls")
    applied = [
        o
        for o in objs
        if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
        or (o["kind"] == "Secret" and o["type"] == "kubernetes.io/service-account-token")
    ]
    kube.apply(applied)
    try:
        for key in ("ca.crt", "tls.crt", "tls.key"):
            (tmp_path / key).write_bytes(base64.b64decode(tls["data"][key]))
        token_secret = next(o["metadata"]["name"] for o in applied if o["kind"] == "Secret")

        def scraper_token() -> str:
            data = kube.get("secret", "-n", NAMESPACE, token_secret).get("data") or {}
            return base64.b64decode(data["token"]).decode() if "token" in data else ""

        token = wait_for(scraper_token, timeout=60)
        assert token, "the API server never filled the scraper's token Secret"
        (tmp_path / "scraper-token").write_text(token)
        account = next(o for o in objs if o["kind"] == "ServiceAccount" and "scraper" not in o["metadata"]["name"])
        plugin_token = kube.kubectl("create", "token", "-n", NAMESPACE, account["metadata"]["name"]).stdout.strip()
        kubeconfig = yaml.safe_load(kube.cluster.kubeconfig.read_text())
        kubeconfig["users"] = [{"name": u["name"], "user": {"token": plugin_token}} for u in kubeconfig["users"]]
        (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
        endpoint = one(objs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
        yield {
            "flags": ["--metrics-auth", "kubernetes", "--kubeconfig", str(tmp_path / "kubeconfig"),
                      "--metrics-tls-cert", str(tmp_path / "tls.crt"), "--metrics-tls-key", str(tmp_path / "tls.key")],
            "scrape": {
                "scheme": endpoint["scheme"],
                "tls_config": {"ca_file": str(tmp_path / "ca.crt"), "server_name": endpoint["tlsConfig"]["serverName"]},
                "authorization": {"type": "Bearer", "credentials_file": str(tmp_path / "scraper-token")},
            },
        }  # fmt: skip
    finally:
        items = {"apiVersion": "v1", "kind": "List", "items": applied}
        kube.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=json.dumps(items), check=False)


@pytest.fixture
def rig(metrics_auth: dict[str, Any]) -> Iterator[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="rdp-pm-", dir="/tmp"))
    fx = fixtures.write_node(str(tmp / "node"), fixtures.lingjun_node(nics=4, bond=True))
    dp = tmp / "dp"
    dp.mkdir()
    sim = KubeletSimulator(str(dp)).start()
    port = free_port()
    log = open(tmp / "plugin.log", "w", encoding="utf-8")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--sysfs-root", fx.sysfs, "--dev-root", fx.dev]
    cmd += ["--procfs-root", fx.procfs, "--device-plugin-dir", str(dp), "--health-file", str(tmp / "health.json")]
    cmd += ["--metrics-address", f"127.0.0.1:{port}", *metrics_auth["flags"]]
    plugin = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    registry = CollectorRegistry()
    registry.register(KubeStateMetrics())
    ksm_server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    ksm_target = f"127.0.0.1:{ksm_server.server_address[1]}"
    values = {
        "metrics": {
            "enabled": True,
            "dashboard": {"enabled": True},
            "prometheusRule": {"enabled": True, "for": dict.fromkeys(chart_for_keys(), "2s")},
        }
    }
    objs = manifests(values)
    groups = one(objs, "PrometheusRule")["spec"]["groups"]
    dashboard = json.loads(one(objs, "ConfigMap", "-dashboard")["data"]["rdma-device-plugin.json"])
    ksm_job = {"job_name": "kube-state-metrics", "static_configs": [{"targets": [ksm_target]}]}
    prom = Prometheus(JOB, [f"127.0.0.1:{port}"], {"node": NODE, "namespace": "kube-system", "pod": "rdma-fixture"}, groups,
                      extra_scrape_configs=[ksm_job], scrape=metrics_auth["scrape"])
    try:
        yield {"fx": fx, "sim": sim, "prom": prom, "dashboard": dashboard, "log": tmp / "plugin.log"}
    finally:
        prom.stop()
        ksm_server.shutdown()
        ksm_server.server_close()
        if plugin.poll() is None:
            plugin.terminate()
            try:
                plugin.wait(15)
            except subprocess.TimeoutExpired:
                plugin.kill()
                plugin.wait()
        sim.stop()
        log.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def firing(prom: Prometheus, name: str, **labels: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom.alerts()
        if a["labels"]["alertname"] == name and a["state"] == "firing" and all(a["labels"].get(k) == v for k, v in labels.items())
    ]


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """Every panel's query as Grafana sends it here: one node, all clusters, a 1m rate window."""
    subst = {"$node": NODE, "$cluster": ".*", "$__rate_interval": "1m"}
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for key, value in subst.items():
                expr = expr.replace(key, value)
            assert "$" not in expr, expr
            out.append((panel["title"], expr))
    return out


def test_dashboard_queries_return_data_and_alerts_see_absence(rig: dict[str, Any]) -> None:
    prom: Prometheus = rig["prom"]
    sim: KubeletSimulator = rig["sim"]
    assert sim.wait_registered(RES, timeout=WAIT), rig["log"].read_text()
    prom.wait_ready(WAIT)
    assert wait_for(lambda: prom.query(f'up{{job="{JOB}"}} == 1')), prom.targets()
    # scraped as the PodMonitor scrapes: HTTPS, with the scraper's token (metrics.auth)
    assert [t["scrapeUrl"][:8] for t in prom.targets() if t["labels"]["job"] == JOB] == ["https://"]

    # before any Allocate: every panel has data, the Allocate histogram included. The not-ready table's
    # columns come from the plugin of a not-ready node: the only one now has no plugin (its row only),
    # so they are checked below, once the fixture node is not ready.
    queries = panel_queries(rig["dashboard"])
    assert len(queries) >= 25
    not_ready_columns = [(t, q) for t, q in queries if t == "Nodes not RDMA-ready" and not q.startswith("max by")]
    assert len(not_ready_columns) == 5
    empty = [(t, q) for t, q in queries if (t, q) not in not_ready_columns and not wait_for(lambda q=q: prom.query(q))]
    assert not empty, f"panels without data: {empty}"
    tables = [p for p in rig["dashboard"]["panels"] if p["type"] == "table"]
    assert len(tables) == 3 and all(t["instant"] for p in tables for t in p["targets"])
    # the NICs' own counters, read at scrape time (issue 31): a bump on the node shows in Prometheus
    rig["fx"].bump_counter("mlx5_bond_0", "port_rcv_data", 2500)
    rx = f'rdma_dp_port_receive_bytes_total{{job="{JOB}",nic="mlx5_bond_0",port="1"}}'
    assert wait_for(lambda: [r for r in prom.query(rx) if r["value"][1] == "10000"]), prom.query(rx)
    for var in rig["dashboard"]["templating"]["list"][1:]:
        series = var["query"].removeprefix("label_values(").rsplit(",", 1)[0].replace("$cluster", ".*")
        assert prom.query(series), var["name"]
    assert prom.query(f'rdma_dp_build_info{{job="{JOB}"}}')[0]["metric"]["node"] == NODE
    p99 = 'histogram_quantile(0.99, sum by (le) (rate(rdma_dp_allocate_seconds_bucket{job="%s"}[1m])))' % JOB
    for pod in ("a", "b"):
        sim.allocate(RES, 1, pod=pod)
    assert wait_for(lambda: [r for r in prom.query(p99) if r["value"][1] != "NaN"]), prom.query(p99)

    # the RDMA node without a plugin (kube-state-metrics says it is one) is named, the fixture node is not
    assert wait_for(lambda: firing(prom, "RdmaDevicePluginMissing", node=MISSING)), prom.alerts()
    assert not firing(prom, "RdmaDevicePluginMissing", node=NODE)
    # 1 of 2 RDMA nodes cannot take RDMA pods: the fleet pages once
    fleet = wait_for(lambda: firing(prom, "RdmaFleetNotReady"))
    assert fleet and fleet[0]["labels"]["severity"] == "critical" and "50%" in fleet[0]["annotations"]["summary"], prom.alerts()
    assert fleet[0]["annotations"]["runbook_url"].startswith("https://")

    # healthy: nothing else fires (the short for: has long passed by now)
    for name in ("RdmaNicPortNotActive", "RdmaAllocatableZero", "RdmaCapacityZero", "RdmaDevicePluginTargetsAbsent",
                 "RdmaNodeLabelsAbsent", "RdmaDevicePluginDown", "RdmaResourceNotRegistered"):
        assert not firing(prom, name), (name, prom.alerts())
    rig["fx"].set_port_state("mlx5_bond_1", "DOWN")
    assert wait_for(lambda: firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_1", port="1", node=NODE)), prom.alerts()
    alert = firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_1")[0]
    assert "mlx5_bond_1" in alert["annotations"]["summary"] and NODE in alert["annotations"]["summary"]
    # default health policy "all": one NIC down leaves the shared pool with nothing allocatable
    assert wait_for(lambda: firing(prom, "RdmaAllocatableZero", resource=RES, node=NODE)), prom.alerts()
    assert "health" not in firing(prom, "RdmaAllocatableZero")[0]["labels"]
    assert not firing(prom, "RdmaNicPortNotActive", nic="mlx5_bond_0")
    # ... and the pool has fewer Healthy NICs than it had: RdmaPoolPartial names the node and resource
    partial = wait_for(lambda: firing(prom, "RdmaPoolPartial", resource=RES, node=NODE))
    assert partial and "has 3 Healthy NICs" in partial[0]["annotations"]["description"], prom.alerts()
    # the fixture node is not ready now: its row in the not-ready table has every column
    empty = [(t, q) for t, q in not_ready_columns if not wait_for(lambda q=q: prom.query(q))]
    assert not empty, f"not-ready columns without data: {empty}"

    # issue 31: a NIC that vanishes leaves the per-NIC series (it kept rdma_dp_port_active 1 before) and is
    # GONE while the pool holds it
    rig["fx"].remove_nic("mlx5_bond_2")
    gone = f'rdma_dp_port_state{{job="{JOB}",nic="mlx5_bond_2",state="GONE"}} == 1'
    assert wait_for(lambda: prom.query(gone)), prom.query(f'rdma_dp_port_state{{nic="mlx5_bond_2"}}')
    assert wait_for(lambda: not prom.query(f'rdma_dp_nic_info{{job="{JOB}",nic="mlx5_bond_2"}}'))
    active = f'rdma_dp_port_active{{job="{JOB}",nic="mlx5_bond_2"}} == 1'
    assert not prom.query(active)
    healthy = f'rdma_dp_pool_nics{{job="{JOB}",resource="{RES}",health="Healthy"}}'
    assert wait_for(lambda: [r for r in prom.query(healthy) if r["value"][1] == "2"]), prom.query(healthy)
