"""The PrometheusRule, the Grafana dashboard and the NFD feature dir: rendered only where asked for and where the API
exists, and every alert unit-tested with the real `promtool test rules` (Debian's prometheus)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import CHART_DIR, VAP_KINDS, by_kind, daemonsets, manifests, one, render_raw

PROMTOOL_DIR = Path(__file__).parent / "promtool"
ALERTS = {
    "RdmaFleetNotReady",
    "RdmaDevicePluginTargetsAbsent",
    "RdmaDevicePluginMissing",
    "RdmaNodeLabelsAbsent",
    "RdmaCapacityZero",
    "RdmaDevicePluginDown",
    "RdmaResourceNotRegistered",
    "RdmaAllocatableZero",
    "RdmaNicPortNotActive",
    "RdmaProbeLoopStale",
    "RdmaReregistrationStorm",
    # issue 31
    "RdmaPoolPartial",
    "RdmaKubeletAllocatableMismatch",
    "RdmaAllocateErrors",
    "RdmaNicPortFlapping",
    "RdmaNicPortErrors",
    "RdmaProbeFailing",
    "RdmaNicHeldDown",
}
ON = {"metrics": {"enabled": True, "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is missing: install Debian's prometheus (make system-deps)")
    return path


def rule_groups(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rule = one(manifests(values or ON), "PrometheusRule")
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


# Each promtool test file reads the rules rendered with these values (its rule_files entry).
RULE_VALUES: dict[str, dict[str, Any]] = {
    "rules.yaml": ON,
    # a hand-written scrape job, no kube-state-metrics, validation.required, a stricter fleet threshold
    "rules-custom.yaml": {
        "validation": {"required": True},
        "metrics": {
            "enabled": True,
            "jobSelector": 'job="rdma-plugins"',
            "prometheusRule": {
                "enabled": True,
                "runbookBaseURL": "https://runbooks.example.com/rdma/",
                "fleet": {"notReadyFraction": 0.25},
                "kubeStateMetrics": {"enabled": False},
            },
        },
    },
    "rules-ksm.yaml": {
        "validation": {"required": True},
        "resourceName": "rdma/hca_roce",
        "extraResources": [{"name": "example.com/ib"}],
        "metrics": {
            "enabled": True,
            "prometheusRule": {"enabled": True, "kubeStateMetrics": {"selector": 'job="ksm"'}},
        },
    },
}


def run_promtool_tests(tmp_path: Path, groups: list[dict[str, Any]] | None = None) -> subprocess.CompletedProcess[str]:
    for name, values in RULE_VALUES.items():
        rendered = groups if (groups is not None and name == "rules.yaml") else rule_groups(values)
        (tmp_path / name).write_text(yaml.safe_dump({"groups": rendered}), encoding="utf-8")
        check = subprocess.run([promtool(), "check", "rules", str(tmp_path / name)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    for test in PROMTOOL_DIR.glob("*.test.yaml"):
        shutil.copy(test, tmp_path / test.name)
    files = sorted(str(p) for p in tmp_path.glob("*.test.yaml"))
    return subprocess.run([promtool(), "test", "rules", *files], capture_output=True, text=True, timeout=300)


def test_promtool_every_alert_fires_and_stays_quiet(tmp_path: Path) -> None:
    groups = rule_groups()
    assert {r["alert"] for g in groups for r in g["rules"]} == ALERTS
    tested = {
        case["alertname"]
        for f in PROMTOOL_DIR.glob("*.test.yaml")
        for t in yaml.safe_load(f.read_text())["tests"]
        for case in t["alert_rule_test"]
    }
    assert tested == ALERTS
    result = run_promtool_tests(tmp_path, groups)
    assert result.returncode == 0, result.stdout + result.stderr


BROKEN = {
    # the rules as they were before issue 22: each blind spot must make the tests fail
    "RdmaDevicePluginDown": "up == 0",
    "RdmaAllocatableZero": (
        'rdma_dp_devices{job="rdma-rdma-device-plugin-metrics",health="Healthy"} == 0 and ignoring(health) '
        'sum without(health) (rdma_dp_devices{job="rdma-rdma-device-plugin-metrics"}) > 0'
    ),
    "RdmaNicPortNotActive": 'rdma_dp_port_active{job="rdma-rdma-device-plugin-metrics"} == 0',
    "RdmaCapacityZero": 'sum by (node) (rdma_dp_devices{job="rdma-rdma-device-plugin-metrics"}) < 0',
    "RdmaDevicePluginMissing": 'up{job="rdma-rdma-device-plugin-metrics"} == 0',
    # issue 31: what a rule would be without the window or the kubelet's stream
    "RdmaNicPortFlapping": (
        'rdma_dp_port_active{job="rdma-rdma-device-plugin-metrics"} == 0 and on(job, instance, nic) '
        'rdma_dp_nic_info{job="rdma-rdma-device-plugin-metrics",resource!=""}'
    ),
    "RdmaResourceNotRegistered": 'rdma_dp_resource_registered{job="rdma-rdma-device-plugin-metrics"} == 0',
    "RdmaNicPortErrors": (
        'sum by (job, instance, node, nic, port) (rate({__name__=~"rdma_dp_port_(symbol_errors|receive_errors)_total",'
        'job="rdma-rdma-device-plugin-metrics"}[10m])) > 0.1'
    ),
}


@pytest.mark.parametrize("alert", sorted(BROKEN))
def test_promtool_tests_catch_a_broken_rule(tmp_path: Path, alert: str) -> None:
    """The same tests fail with the old expression of an alert (up == 0 sees no missing target, a
    health label leaks, an unused NIC's port fires, capacity 0 is never seen)."""
    groups = rule_groups()
    (rule,) = [r for r in groups[0]["rules"] if r["alert"] == alert]
    rule["expr"] = BROKEN[alert]
    result = run_promtool_tests(tmp_path, groups)
    assert result.returncode != 0
    assert alert in result.stdout + result.stderr


def test_promtool_tests_catch_a_lost_for(tmp_path: Path) -> None:
    groups = rule_groups()
    for rule in groups[0]["rules"]:
        if rule["alert"] in ("RdmaNicPortNotActive", "RdmaReregistrationStorm"):
            rule["for"] = "0m"
    out = run_promtool_tests(tmp_path, groups)
    assert out.returncode != 0
    assert "RdmaNicPortNotActive" in out.stdout + out.stderr and "RdmaReregistrationStorm" in out.stdout + out.stderr


def test_short_for_from_values() -> None:
    groups = rule_groups({"metrics": {"enabled": True, "prometheusRule": {"enabled": True, "for": {"nicPortNotActive": "5s"}}}})
    port = next(r for r in groups[0]["rules"] if r["alert"] == "RdmaNicPortNotActive")
    assert port["for"] == "5s"


FLEET_ALERTS = {"RdmaFleetNotReady", "RdmaDevicePluginTargetsAbsent", "RdmaNodeLabelsAbsent"}


def test_every_alert_names_node_and_links_its_runbook() -> None:
    runbooks = (Path(__file__).parents[3] / "docs" / "alerts.md").read_text(encoding="utf-8")
    base = "https://github.com/lingjun-rdma/rdma-device-plugin/blob/main/docs/alerts.md"
    for rule in rule_groups()[0]["rules"]:
        ann = rule["annotations"]
        if rule["alert"] not in FLEET_ALERTS:
            assert "{{ $labels.node }}" in ann["summary"], rule["alert"]
        assert ann["runbook_url"] == f"{base}#{rule['alert'].lower()}"
        assert f"## {rule['alert']}" in runbooks, f"docs/alerts.md has no runbook for {rule['alert']}"
        # mixins page on the fleet, not per node: a 1000-node fleet must not page 1000 times
        expected = "critical" if rule["alert"] in ("RdmaFleetNotReady", "RdmaDevicePluginTargetsAbsent") else "warning"
        assert rule["labels"]["severity"] == expected, rule["alert"]
        assert rule["for"] and not rule["for"].startswith("0"), rule["alert"]


def test_docs_alerts_table_matches_the_rules() -> None:
    """docs/alerts.md's table lists every rendered alert with its for and severity."""
    import re

    text = (Path(__file__).parents[3] / "docs" / "alerts.md").read_text(encoding="utf-8")
    rows = {m[0]: (m[1], m[2]) for m in re.findall(r"^\| (Rdma\w+) \|[^\n]*\| `?(\w+)`? \| (critical|warning) \|$", text, flags=re.M)}
    from test_dra_chart import dra_rule_groups

    rules = {r["alert"]: (r["for"], r["labels"]["severity"]) for r in [*rule_groups()[0]["rules"], *dra_rule_groups()[1]["rules"]]}
    assert rows == rules


@pytest.mark.parametrize(
    "bad,needle",
    [("docs/alerts.md", "/metrics/prometheusRule/runbookBaseURL"), ("ftp://x/alerts.md", "/metrics/prometheusRule/runbookBaseURL")],
)
def test_runbook_base_url_must_be_absolute(bad: str, needle: str) -> None:
    values = {"metrics": {"enabled": True, "prometheusRule": {"enabled": True, "runbookBaseURL": bad}}}
    with pytest.raises(Exception, match=needle):
        rule_groups(values)


@pytest.mark.parametrize("bad", ["0m", "0s", "00m"])
def test_no_alert_may_lose_its_for(bad: str) -> None:
    values = {"metrics": {"enabled": True, "prometheusRule": {"enabled": True, "for": {"reregistrationStorm": bad}}}}
    with pytest.raises(Exception, match="/metrics/prometheusRule/for/reregistrationStorm"):
        rule_groups(values)


@pytest.mark.parametrize("bad", ['job=rdma', 'job="a" or up', "{job=\"a\"}"])
def test_job_selector_must_be_label_matchers(bad: str) -> None:
    with pytest.raises(Exception, match="/metrics/jobSelector"):
        rule_groups({"metrics": {"enabled": True, "jobSelector": bad, "prometheusRule": {"enabled": True}}})


def test_job_selector_reaches_every_rule() -> None:
    values = {"metrics": {"enabled": True, "jobSelector": 'job="rdma-plugins",namespace="gpu"',
                          "prometheusRule": {"enabled": True}, "dashboard": {"enabled": True}}}
    for rule in rule_groups(values)[0]["rules"]:
        if rule["alert"] != "RdmaNodeLabelsAbsent":
            assert 'job="rdma-plugins",namespace="gpu"' in rule["expr"], rule["alert"]
        assert "rdma-rdma-device-plugin-metrics" not in rule["expr"]
    port = next(r for r in rule_groups()[0]["rules"] if r["alert"] == "RdmaNicPortNotActive")
    assert "{{ $labels.nic }}" in port["annotations"]["summary"]


def test_rule_and_dashboard_off_by_default() -> None:
    objs = manifests({"metrics": {"enabled": True}})
    assert not by_kind(objs, "PrometheusRule")
    assert not [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]


def test_rule_needs_the_monitoring_api() -> None:
    with pytest.raises(Exception, match=r"metrics.prometheusRule.enabled=true needs the prometheus-operator API"):
        render_raw(ON, api_versions=tuple(VAP_KINDS))
    rendered = render_raw(ON, kube_version=None, api_versions=("monitoring.coreos.com/v1",))
    assert "kind: PrometheusRule" in rendered["rdma-device-plugin/templates/prometheusrule.yaml"]


@pytest.mark.parametrize("name", ["prometheusRule", "dashboard"])
def test_rule_and_dashboard_need_metrics(name: str) -> None:
    with pytest.raises(Exception, match=rf"metrics.{name}.enabled=true needs metrics.enabled=true"):
        render_raw({"metrics": {name: {"enabled": True}}})


def dashboard(values: dict[str, Any] | None = None) -> dict[str, Any]:
    cm = one(manifests(values or ON), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    doc: dict[str, Any] = json.loads(cm["data"]["rdma-device-plugin.json"])
    return doc


def dashboard_queries(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in doc["panels"] if p["type"] != "row" for t in p["targets"]]


def test_dashboard_fleet_and_node_view() -> None:
    doc = dashboard()
    rows = [p["title"] for p in doc["panels"] if p["type"] == "row"]
    assert rows == ["Fleet", "Node $node"]
    queries = dashboard_queries(doc)
    assert all('job="rdma-rdma-device-plugin-metrics"' in q and 'cluster=~"$cluster"' in q for _, q in queries)
    for placeholder in ("__SELECTOR__", "__UID__", "__RDMA_NODES__", "__RELEASE__"):
        assert placeholder not in json.dumps(doc)
    titles = {t for t, _ in queries}
    for want in ("Nodes RDMA-ready", "Nodes not RDMA-ready", "Allocatable vs capacity, fleet", "Port states", "NICs",
                 "Allocate latency, fleet (p50, p99)", "Throughput per NIC", "Congestion per NIC",
                 "Errors and retransmits per NIC", "Top 10 nodes by link errors"):
        assert want in titles
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "cluster", "node"]
    cluster, node = doc["templating"]["list"][1:]
    # all clusters by default; ".*" also matches series without a cluster label (one cluster)
    assert cluster["includeAll"] is True and cluster["allValue"] == ".*"
    # issue 31: "All" nodes is ".*", not a regex of 2,000 names
    assert node["includeAll"] is True and node["allValue"] == ".*"
    assert doc["schemaVersion"] >= 41  # Grafana 11.6 / 12


def _fleet_panels(doc: dict[str, Any]) -> list[dict[str, Any]]:
    panels = doc["panels"]
    node_row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith("Node"))
    return [p for p in panels[1:node_row] if p["type"] != "row"]


def test_dashboard_fleet_row_scales_to_2000_nodes() -> None:
    """Issue 31: the fleet row draws no line per node (aggregates, quantiles, top 10), its table lists only
    the nodes that are not ready, and the not-ready count comes from kube-state-metrics' RDMA node labels
    as the alerts do, so a node without a plugin or whose plugin is down counts."""
    doc = dashboard()
    for panel in _fleet_panels(doc):
        for target in panel["targets"]:
            expr = target["expr"]
            per_node = re.search(r"by \((?:[^)]*,\s*)?node\b", expr)
            if panel["type"] == "timeseries" and per_node:
                assert expr.startswith(("topk(10,", "count(")), (panel["title"], expr)
            if panel["type"] == "table":
                assert "unless on(node)" in expr and "kube_node_labels" in expr, (panel["title"], expr)
    stat_panel = next(p for p in _fleet_panels(doc) if p["title"] == "Nodes RDMA-ready")
    not_ready = next(t["expr"] for t in stat_panel["targets"] if t["legendFormat"] == "not ready")
    assert 'kube_node_labels{cluster=~"$cluster",label_feature_node_kubernetes_io_pci_15b3_present="true"}' in not_ready
    # without kube-state-metrics: the plugin targets, down ones included (up == 0 is not ready)
    values = {"metrics": {"enabled": True, "dashboard": {"enabled": True},
                          "prometheusRule": {"kubeStateMetrics": {"enabled": False}}}}
    stat_panel = next(p for p in _fleet_panels(dashboard(values)) if p["title"] == "Nodes RDMA-ready")
    not_ready = next(t["expr"] for t in stat_panel["targets"] if t["legendFormat"] == "not ready")
    assert "kube_node_labels" not in not_ready
    assert 'group by (node) (up{job="rdma-rdma-device-plugin-metrics",cluster=~"$cluster"})' in not_ready


def test_dashboard_panels_have_ids_tables_are_instant_rates_use_rate_interval() -> None:
    doc = dashboard()
    ids = [p["id"] for p in doc["panels"]]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids) == len(doc["panels"])
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            if panel["type"] == "table":
                # one row per node/NIC with its labels as columns, not one frame per series
                assert target["instant"] is True and target["format"] == "table", panel["title"]
            for window in re.findall(r"\[([^\]]+)\]", expr):
                assert window == "$__rate_interval", (panel["title"], expr)
        if panel["type"] == "table":
            ids_ = [t["id"] for t in panel["transformations"]]
            assert "organize" in ids_ and (len(panel["targets"]) == 1 or "merge" in ids_), panel["title"]
            organize = next(t for t in panel["transformations"] if t["id"] == "organize")["options"]
            assert organize["excludeByName"].get("Time") is True and organize["renameByName"], panel["title"]


def test_dashboard_uid_and_title_per_release() -> None:
    """Two releases in one Grafana: different uids (at most 40 characters) and titles (unique per folder)."""
    values = ON
    docs = []
    for name, namespace in (("rdma", "kube-system"), ("rdma-b", "kube-system"), ("rdma", "gpu")):
        rendered = render_raw(values, name=name, namespace=namespace)
        cm = next(d for d in yaml.safe_load_all(rendered["rdma-device-plugin/templates/dashboard.yaml"]) if d)
        docs.append(json.loads(cm["data"]["rdma-device-plugin.json"]))
    uids = [d["uid"] for d in docs]
    assert len(set(uids)) == 3 and all(len(u) <= 40 and re.match(r"^[a-zA-Z0-9_-]+$", u) for u in uids)
    assert len({d["title"] for d in docs}) == 3 and docs[1]["title"] == "RDMA device plugin (kube-system/rdma-b)"
    assert uids[0] == dashboard()["uid"]  # stable: the same release keeps its uid across upgrades


def test_dashboard_is_generated_by_the_sdk() -> None:
    """files/dashboards/rdma-device-plugin.json is what dashboards/build.py (grafana-foundation-sdk) builds."""
    build = CHART_DIR / "dashboards" / "build.py"
    result = subprocess.run([sys.executable, str(build), "--check"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "grafana_foundation_sdk" in build.read_text(encoding="utf-8")


def test_job_selector_reaches_every_panel() -> None:
    values = {"metrics": {"enabled": True, "jobSelector": 'job="rdma-plugins",namespace="gpu"', "dashboard": {"enabled": True}}}
    doc = dashboard(values)
    assert "rdma-rdma-device-plugin-metrics" not in json.dumps(doc)
    assert all('job="rdma-plugins",namespace="gpu"' in q for _, q in dashboard_queries(doc))
    assert all('job="rdma-plugins",namespace="gpu"' in v["query"] for v in doc["templating"]["list"][1:])


def test_nfd_feature_dir_mounted_only_when_enabled() -> None:
    for mode, ds in daemonsets({"nfd": {"enabled": True, "featuresDir": "/etc/nfd/features.d"}}).items():
        pod = ds["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = container["args"]
        assert args[args.index("--nfd-features-file") + 1] == "/host/nfd-features.d/rdma-device-plugin", mode
        mount = next(m for m in container["volumeMounts"] if m["name"] == "nfd-features")
        assert mount["mountPath"] == "/host/nfd-features.d" and not mount.get("readOnly")
        volume = next(v for v in pod["volumes"] if v["name"] == "nfd-features")
        assert volume["hostPath"] == {"path": "/etc/nfd/features.d", "type": "DirectoryOrCreate"}
    for ds in daemonsets().values():
        pod = ds["spec"]["template"]["spec"]
        assert "--nfd-features-file" not in pod["containers"][0]["args"]
        assert all(v["name"] != "nfd-features" for v in pod["volumes"])
