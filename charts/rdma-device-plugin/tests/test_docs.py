"""values.yaml documents every key (## @param), the README table lists each one, the schema knows
each one, and the examples are valid Kubernetes objects."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import yaml
from conftest import CHART_DIR, example_jobs, kube_minor_versions

VALUES_TEXT = (CHART_DIR / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
PARAMS = re.findall(r"^\s*## @param (\S+) \S", VALUES_TEXT, flags=re.M)
README = (CHART_DIR / "README.md").read_text()
SCHEMA = json.loads((CHART_DIR / "values.schema.json").read_text())


def _leaves(node: dict, prefix: str = "") -> set[str]:
    """Keys a user sets: nested value groups are descended, everything else is a leaf."""
    out = set()
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in {"affinity", "resources", "updateStrategy"}:
            out |= _leaves(value, path + ".")
        else:
            out.add(path)
    return out


def test_every_value_has_a_param_line() -> None:
    assert len(PARAMS) == len(set(PARAMS))
    assert _leaves(VALUES) == set(PARAMS)


def test_readme_table_lists_every_param() -> None:
    rows = set(re.findall(r"^\| `([^`]+)` \|", README, flags=re.M))
    assert set(PARAMS) <= rows


def test_schema_knows_every_param() -> None:
    for param in PARAMS:
        node = SCHEMA
        for part in param.split("."):
            node = node["properties"][part]
        assert node["description"]


def test_examples_valid_and_documented() -> None:
    jobs = example_jobs()
    assert len(jobs) == 2
    for name, job in jobs.items():
        assert job["metadata"]["name"] == name
        for version in (kube_minor_versions()[0], kube_minor_versions()[-1]):
            kubernetes_validate.validate(job, version, strict=True)
        text = (CHART_DIR / "examples" / f"{name}.yaml").read_text()
        assert "placeholder" in text
        assert name in README
