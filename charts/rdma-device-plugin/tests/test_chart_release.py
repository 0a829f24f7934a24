"""Releasing the chart: Chart.yaml metadata (home, sources, maintainers, icon, Artifact Hub
annotations), its CHANGELOG, and the version-bump rule checked against the recorded interface.

    .venv/bin/python charts/rdma-device-plugin/tests/test_chart_release.py --write   # record the interface

Rule (CHANGELOG.md "Versioning rule"): a DaemonSet selector change, a value removed or a value whose
type changes needs a new major version; an added value a new minor (or major) version."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import CHART_DIR, daemonsets  # noqa: E402

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


def chart_api() -> dict[str, Any]:
    schema = json.loads((CHART_DIR / "values.schema.json").read_text(encoding="utf-8"))
    return {
        "selectors": {mode: ds["spec"]["selector"] for mode, ds in sorted(daemonsets({}).items())},
        "values": schema_paths(schema),
    }


def bump_needed(recorded: dict[str, Any], current: dict[str, Any]) -> str:
    """"major", "minor" or "" for a change of the interface from recorded to current."""
    removed_or_retyped = [p for p, t in recorded["values"].items() if current["values"].get(p) != t]
    if recorded["selectors"] != current["selectors"] or removed_or_retyped:
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
        assert new[0] > old[0], f"the selectors or a value's path/type changed since {recorded['version']}: {fix}"
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


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        API_FILE.write_text(json.dumps({"version": CHART_YAML["version"], "api": chart_api()}, indent=2, sort_keys=True) + "\n")
        print(f"recorded the interface of chart {CHART_YAML['version']} in {API_FILE}")
    else:
        sys.exit("usage: test_chart_release.py --write")
