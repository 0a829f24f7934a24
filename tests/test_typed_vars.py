"""Typed inventory variables: every boolean/integer variable of every role's argument_specs is read
through the one boundary (filter_plugins/rdma_typed.py), so `-e name=true` / `-e name=500` from the
command line means the same as a YAML boolean/integer in group_vars."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

sys.path.insert(0, str(ROOT / "plugins" / "filter"))
from rdma_typed import rdma_bool, rdma_int

EXPRESSION_KEYS = {"when", "that", "until", "changed_when", "failed_when"}
JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
FILTER = {"bool": "lingjun.rdma.rdma_bool", "int": "lingjun.rdma.rdma_int"}


def typed_variables() -> dict[str, str]:
    found: dict[str, str] = {}
    for spec in sorted(ROOT.glob("roles/*/meta/argument_specs.yml")):
        for entry in yaml.safe_load(spec.read_text())["argument_specs"].values():
            for name, option in (entry.get("options") or {}).items():
                kind = option.get("type")
                if kind in FILTER:
                    assert found.setdefault(name, kind) == kind, f"{name} is typed differently in {spec}"
    return found


TYPED = typed_variables()


def _strings(node: object, bare: bool = False) -> Iterator[tuple[str, bool]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(value, bare=key in EXPRESSION_KEYS)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item, bare)
    elif isinstance(node, str):
        yield node, bare


def expressions() -> Iterator[tuple[Path, str]]:
    """Every Jinja expression of the roles and playbooks: {{ }} / {% %} segments, and the bare
    expressions of when/that/until/changed_when/failed_when."""
    files = [p for p in ROOT.glob("roles/*/*/**/*") if p.is_file() and "meta" not in p.parts]
    files += sorted(ROOT.glob("playbooks/*.yml"))
    for path in sorted(files):
        if path.parent.name == "defaults" or path.suffix not in {".yml", ".j2"}:
            continue
        text = path.read_text()
        if path.suffix == ".j2":
            for segment in JINJA.findall(text):
                yield path, segment
            continue
        for text_value, bare in _strings(yaml.safe_load(text)):
            if bare:
                yield path, text_value
            for segment in JINJA.findall(text_value):
                yield path, segment


@pytest.mark.parametrize("name", sorted(TYPED))
def test_every_read_goes_through_the_boundary(name: str) -> None:
    """One test per typed variable: each read is `name | lingjun.rdma.rdma_bool('name')` /
    `| lingjun.rdma.rdma_int('name')` (or an `is defined` / `is none` test), never a bare read, `| bool`,
    `| int` or `| to_json`."""
    ok = re.compile(
        rf"\b{name}\b(\s*\|\s*{re.escape(FILTER[TYPED[name]])}\('{name}'\)|\s+is\s+(not\s+)?(defined|undefined|none)\b)"
    )
    bad = []
    for path, raw in expressions():
        # prose inside string literals is no read
        expr = re.sub(r"'[^']*'", lambda m: m[0] if m[0] == f"'{name}'" else "''", raw)
        for match in re.finditer(rf"(?<!')\b{name}\b(?!')", expr):
            if not ok.match(expr, match.start()):
                bad.append(f"{path.relative_to(ROOT)}: {expr.strip()[:120]}")
    assert not bad, f"{name} read without | {FILTER[TYPED[name]]}('{name}'):\n" + "\n".join(bad)


@pytest.mark.parametrize("text", ["true", "True", "yes", "on", "1", "y", True, 1])
def test_bool_accepts_the_ansible_spellings_of_true(text: object) -> None:
    assert rdma_bool(text, "rdma_non_host_network") is True


@pytest.mark.parametrize("text", ["false", "False", "no", "off", "0", "n", False, 0])
def test_bool_accepts_the_ansible_spellings_of_false(text: object) -> None:
    assert rdma_bool(text, "rdma_non_host_network") is False


@pytest.mark.parametrize("text,want", [("500", 500), (" 500 ", 500), (500, 500), (None, None)])
def test_int_accepts_decimal_text(text: object, want: int | None) -> None:
    assert rdma_int(text, "rdma_shared_devices") == want


def test_bad_values_name_the_variable_and_the_fix() -> None:
    from ansible.errors import AnsibleFilterError

    with pytest.raises(
        AnsibleFilterError, match=r"rdma_non_host_network='maybe' is not a boolean.*-e rdma_non_host_network=true"
    ):
        rdma_bool("maybe", "rdma_non_host_network")
    with pytest.raises(
        AnsibleFilterError, match=r"rdma_shared_devices='lots' is not an integer.*-e rdma_shared_devices="
    ):
        rdma_int("lots", "rdma_shared_devices")
    with pytest.raises(AnsibleFilterError, match="rdma_shared_devices=True is not an integer"):
        rdma_int(True, "rdma_shared_devices")
