"""Releasing the chart: Chart.yaml metadata (home, sources, maintainers, icon, Artifact Hub
annotations), its CHANGELOG, and the version-bump rule checked against the recorded interface.

    .venv/bin/python charts/rdma-device-plugin/tests/test_chart_release.py --write   # record the interface

Rule (CHANGELOG.md "Versioning rule"): a DaemonSet selector change, a value removed or a value whose
type changes, or a default plugin config that hands RDMA containers something else (a changed or
removed default, a new setting that is on by default) needs a new major version; an added value a new
minor (or major) version."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CHART_DIR, daemonsets, manifests, one  # noqa: E402

CHART_YAML = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text(encoding="utf-8"))
CHANGELOG = (CHART_DIR / "CHANGELOG.md").read_text(encoding="utf-8")
API_FILE = Path(__file__).resolve().parent / "chart-api.json"
KINDS = {"Added": "added", "Changed": "changed", "Deprecated": "deprecated", "Removed": "removed", "Fixed": "fixed",
         "Security": "security"}


def version_tuple(version: str) -> tuple[int, int, int]:
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)", version)
    assert m, version
    return int(m[1]), int(m[2]), int(m[3])


def changelog_changes(version: str) -> list[dict[str, str]]:
    """The CHANGELOG section of `version` as Artifact Hub's changes: one entry per bullet, its kind from
    the ### heading, backticks dropped and lines joined."""
    section = CHANGELOG.split(f"\n## {version}\n", 1)[1].split("\n## ", 1)[0]
    changes = []
    for heading, body in re.findall(r"^### (\w+)\n(.*?)(?=^### |\Z)", section, flags=re.M | re.S):
        for bullet in re.split(r"^- ", body, flags=re.M)[1:]:
            changes.append({"kind": KINDS[heading], "description": " ".join(bullet.replace("`", "").split())})
    return changes


def schema_paths(node: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """value path -> its JSON type(s), down to the leaves the chart defines (not the Kubernetes $defs)."""
    out: dict[str, str] = {}
    for key, sub in (node.get("properties") or {}).items():
        path = f"{prefix}{key}"
        kind = sub.get("type") or "+".join(sorted(str(o.get("type", o.get("$ref", "?"))) for o in sub.get("oneOf", sub.get("anyOf", []))))
        out[path] = kind if isinstance(kind, str) else "+".join(sorted(kind))
        if sub.get("properties"):
            out.update(schema_paths(sub, path + "."))
    return out


def default_configs() -> dict[str, Any]:
    """mode -> the plugin config the chart renders with default values (what every node's plugin does,
    and so what every RDMA container gets), without pluginVersion (the plugin's own version rule)."""
    out = {}
    for mode in ("shared", "exclusive"):
        cm = one(manifests({}), "ConfigMap", f"-{mode}")
        config = yaml.safe_load(cm["data"]["config.yaml"])
        config.pop("pluginVersion", None)
        out[mode] = config
    return out


def _off(value: Any) -> bool:
    """A setting that changes nothing by default: false, empty, or a section whose `enabled` is false."""
    if isinstance(value, dict):
        return value.get("enabled") is False or all(_off(v) for v in value.values())
    return value in (False, None, "", 0) or value == []


def config_changes(old: Any, new: Any, path: str = "") -> list[str]:
    """Paths where the default config hands pods something else: changed, removed, or added and on."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            sub = f"{path}.{key}" if path else key
            if key not in new:
                out.append(f"{sub} removed")
            elif key not in old:
                out += [] if _off(new[key]) else [f"{sub} added, on by default"]
            else:
                out += config_changes(old[key], new[key], sub)
        return out
    return [] if old == new else [f"{path} changed from {old!r} to {new!r}"]


def chart_api() -> dict[str, Any]:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text(encoding="utf-8"))
    return {
        "selectors": {mode: ds["spec"]["selector"] for mode, ds in sorted(daemonsets({}).items())},
        "values": schema_paths(schema),
        "config": default_configs(),
    }


def bump_needed(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """"major", "minor" or "" for a change of the interface from recorded to current."""
    removed_or_retyped = [p for p, t in recorded["values"].items() if current["values"].get(p) != t]
    config = config_changes(recorded.get("config", current["config"]), current["config"])
    if recorded["selectors"] != current["selectors"] or removed_or_retyped or config:
        return "major"
    return "minor" if set(current["values"]) - set(recorded["values"]) else ""


def test_chart_yaml_metadata_for_artifact_hub() -> None:
    assert CHART_YAML["home"].startswith("https://") and CHART_YAML["sources"][0].startswith("https://")
    assert CHART_YAML["icon"].startswith("https://") and (CHART_DIR / "icon.svg").is_file()
    assert CHART_YAML["maintainers"] and all(m["name"] for m in CHART_YAML["maintainers"])
    ann = CHART_YAML["annotations"]
    assert ann["artifacthub.io/license"] == "Apache-2.0" and ann["artifacthub.io/prerelease"] in ("true", "false")
    links = yaml.safe_load(ann["artifacthub.io/links"])
    assert links and all(link["url"].startswith("https://") for link in links)
    # the image Artifact Hub scans is the one the chart deploys by default
    (image,) = yaml.safe_load(ann["artifacthub.io/images"])
    default = daemonsets({})["shared"]["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image["image"] == default


def test_changelog_has_this_version_and_artifact_hub_lists_it() -> None:
    version = CHART_YAML["version"]
    assert f"\n## {version}\n" in CHANGELOG, f"CHANGELOG.md has no section for chart version {version}"
    changes = yaml.safe_load(CHART_YAML["annotations"]["artifacthub.io/changes"])
    assert changes == changelog_changes(version), "Chart.yaml artifacthub.io/changes must list this version's CHANGELOG entries"


def test_version_bump_rule() -> None:
    recorded = json.loads(API_FILE.read_text(encoding="utf-8"))
    current = chart_api()
    needed = bump_needed(recorded["api"], current)
    old, new = version_tuple(recorded["version"]), version_tuple(CHART_YAML["version"])
    fix = "bump version in Chart.yaml (CHANGELOG.md: versioning rule), then run this file with --write"
    if needed == "major":
        changes = config_changes(recorded["api"].get("config", current["config"]), current["config"])
        assert new[0] > old[0], (
            f"the selectors, a value's path/type or the default plugin config ({changes}) changed since "
            f"{recorded['version']}: {fix}"
        )
    elif needed == "minor":
        assert new > old and (new[0] > old[0] or new[1] > old[1]), f"values were added since {recorded['version']}: {fix}"
    assert new >= old


def test_the_rule_sees_breaking_and_additive_changes() -> None:
    api = chart_api()
    assert bump_needed(api, api) == ""
    removed = json.loads(json.dumps(api))
    removed["values"]["metrics.jobSelector"] = "string"
    removed["values"]["gone"] = "string"
    assert bump_needed(removed, api) == "major"  # a value the old chart had is gone
    retyped = json.loads(json.dumps(api))
    retyped["values"]["sharedDevices"] = "string"
    assert bump_needed(retyped, api) == "major"
    selector = json.loads(json.dumps(api))
    selector["selectors"]["shared"]["matchLabels"]["app.kubernetes.io/part-of"] = "x"
    assert bump_needed(selector, api) == "major"
    older = json.loads(json.dumps(api))
    del older["values"]["validation.required"]
    assert bump_needed(older, api) == "minor"


def test_the_rule_applied_to_1_1_0s_default() -> None:
    """1.0.0's default config had no workloadEnv; 1.1.0 added it on by default, changing the env of every
    RDMA container: the rule asks for a major version (1.1.0 was a minor; 2.0.0 carries it)."""
    api = chart_api()
    v1_0 = json.loads(json.dumps(api))
    for config in v1_0["config"].values():
        del config["workloadEnv"]
    assert config_changes(v1_0["config"]["shared"], api["config"]["shared"]) == ["workloadEnv added, on by default"]
    assert bump_needed(v1_0, api) == "major"
    # the same setting added off by default would have been a minor
    off = json.loads(json.dumps(api))
    for config in off["config"].values():
        config["workloadEnv"]["enabled"] = False
    v1_0_off = json.loads(json.dumps(v1_0))
    assert bump_needed(v1_0_off, off) == ""  # (its values.yaml keys would make it a minor)
    assert config_changes(v1_0_off["config"]["shared"], off["config"]["shared"]) == []
    # a changed default is major too, a pod-facing one or not
    changed = json.loads(json.dumps(api))
    changed["config"]["shared"]["charDevices"]["umad"] = True
    assert config_changes(changed["config"]["shared"], api["config"]["shared"]) == [
        "charDevices.umad changed from True to False"
    ]
    assert bump_needed(changed, api) == "major"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        API_FILE.write_text(json.dumps({"version": CHART_YAML["version"], "api": chart_api()}, indent=2, sort_keys=True) + "\n")
        print(f"recorded the interface of chart {CHART_YAML['version']} in {API_FILE}")
    else:
        sys.exit("usage: test_chart_release.py --write")
