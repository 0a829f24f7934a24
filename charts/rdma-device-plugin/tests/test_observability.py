"""The PrometheusRule, the Grafana dashboard and the NFD feature dir: rendered only where asked for and where the API
exists, and every alert unit-tested with the real `promtool test rules` (Debian's prometheus)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import VAP_KINDS, by_kind, daemonsets, manifests, one, render_raw

PROMTOOL_DIR = Path(__file__).parent / "promtool"
ALERTS = {
    "RdmaDevicePluginDown",
    "RdmaResourceNotRegistered",
    "RdmaAllocatableZero",
    "RdmaNicPortNotActive",
    "RdmaProbeLoopStale",
    "RdmaReregistrationStorm",
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


def run_promtool_tests(tmp_path: Path, groups: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    for test in PROMTOOL_DIR.glob("*.test.yaml"):
        shutil.copy(test, tmp_path / test.name)
    check = subprocess.run([promtool(), "check", "rules", str(tmp_path / "rules.yaml")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
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


def test_promtool_tests_catch_a_broken_rule(tmp_path: Path) -> None:
    """The same tests fail when an alert loses its `for` (fires at once) or names the wrong job."""
    groups = rule_groups()
    for rule in groups[0]["rules"]:
        if rule["alert"] == "RdmaNicPortNotActive":
            rule["for"] = "0m"
        if rule["alert"] == "RdmaDevicePluginDown":
            rule["expr"] = "up == 0"
    result = run_promtool_tests(tmp_path, groups)
    assert result.returncode != 0
    assert "RdmaNicPortNotActive" in result.stdout + result.stderr
    assert "RdmaDevicePluginDown" in result.stdout + result.stderr


def test_short_for_from_values() -> None:
    groups = rule_groups({"metrics": {"enabled": True, "prometheusRule": {"enabled": True, "for": {"nicPortNotActive": "5s"}}}})
    port = next(r for r in groups[0]["rules"] if r["alert"] == "RdmaNicPortNotActive")
    assert port["for"] == "5s"


def test_every_alert_names_node_and_links_its_runbook() -> None:
    runbooks = (Path(__file__).parents[3] / "docs" / "alerts.md").read_text(encoding="utf-8")
    for rule in rule_groups()[0]["rules"]:
        ann = rule["annotations"]
        assert "{{ $labels.node }}" in ann["summary"], rule["alert"]
        assert ann["runbook_url"] == f"docs/alerts.md#{rule['alert'].lower()}"
        assert f"## {rule['alert']}" in runbooks, f"docs/alerts.md has no runbook for {rule['alert']}"
        assert rule["labels"]["severity"] in ("critical", "warning")
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
    assert all('job="rdma-rdma-device-plugin-metrics"' in q for _, q in queries)
    assert "__JOB__" not in json.dumps(doc)
    titles = {t for t, _ in queries}
    for want in ("Nodes RDMA-ready", "Allocatable vs capacity per node", "Port states", "Allocate latency (p99)"):
        assert want in titles
    assert [v["name"] for v in doc["templating"]["list"]] == ["datasource", "node"]


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
