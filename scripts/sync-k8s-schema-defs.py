#!/usr/bin/env python3
"""Copy the Kubernetes definitions the chart's values use (SecurityContext, Toleration, Affinity,
Volume, VolumeMount, ResourceRequirements) into charts/rdma-device-plugin/values.schema.json under "$defs", verbatim from
the strict schemas bundled with kubernetes-validate (one source: the Kubernetes OpenAPI), with every
definition they reference and refs made local. Strict = unknown keys are rejected, as
`kubectl --validate=strict` would. One definition is tightened: Quantity (QUANTITY_DEF below).

    .venv/bin/python scripts/sync-k8s-schema-defs.py           rewrite "$defs"
    .venv/bin/python scripts/sync-k8s-schema-defs.py --check   exit 1 when they drift (chart test)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate.utils as kvu

SCHEMA = Path(__file__).resolve().parents[1] / "charts" / "rdma-device-plugin" / "values.schema.json"
ROOTS = ("Affinity", "ResourceRequirements", "SecurityContext", "Toleration", "Volume", "VolumeMount")
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
# The OpenAPI says only "string or number" for a Quantity; the API server parses it by the grammar of
# k8s.io/apimachinery/pkg/api/resource/quantity.go (<signedNumber><suffix>, suffix one of Ki Mi Gi Ti
# Pi Ei, m "" k M G T P E, or e/E<signedNumber>), so "128MB" or "1 Gi" pass the schema and fail the
# install. The chart checks that grammar (unsigned: a negative request or limit is invalid too).
QUANTITY_DEF = {
    "oneOf": [
        {
            "type": "string",
            "pattern": r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
        },
        {"type": "number", "minimum": 0},
    ]
}
PREFIX = "io.k8s.api.core.v1."
REMOTE = "#/$defs/"  # refs inside _definitions.json are already local


def kubernetes_version() -> str:
    """The newest Kubernetes whose schemas kubernetes-validate bundles."""
    return max(kvu.all_versions(), key=lambda v: tuple(int(p) for p in v.split(".")))


def _definitions(version: str) -> dict[str, Any]:
    import kubernetes_validate

    base = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local-strict"
    defs: dict[str, Any] = json.loads((base / "_definitions.json").read_text())["$defs"]
    return defs


def _localize(node: Any, wanted: set[str]) -> Any:
    """Rewrite refs to "#/$defs/..." and collect the names they point at; drop descriptions (size)."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description":
                continue
            if key == "$ref" and isinstance(value, str) and value.startswith(REMOTE):
                name = value[len(REMOTE):]
                wanted.add(name)
                out[key] = "#/$defs/" + name
            else:
                out[key] = _localize(value, wanted)
        return out
    if isinstance(node, list):
        return [_localize(v, wanted) for v in node]
    return node


def build() -> dict[str, Any]:
    version = kubernetes_version()
    source = _definitions(version)
    todo, done = [PREFIX + r for r in ROOTS], {}
    while todo:
        name = todo.pop()
        if name in done:
            continue
        wanted: set[str] = set()
        done[name] = _localize(source[name], wanted)
        todo.extend(sorted(wanted - set(done)))
    done[QUANTITY] = QUANTITY_DEF
    return dict(sorted(done.items()))


def main() -> int:
    schema = json.loads(SCHEMA.read_text())
    defs = build()
    comment = f"$defs: Kubernetes {kubernetes_version()} strict definitions written by scripts/sync-k8s-schema-defs.py; do not edit them"
    if "--check" in sys.argv[1:]:
        if schema.get("$defs") != defs or schema.get("$comment") != comment:
            print(f"{SCHEMA}: $defs differ from kubernetes-validate's; run scripts/sync-k8s-schema-defs.py", file=sys.stderr)
            return 1
        return 0
    schema["$comment"] = comment
    schema["$defs"] = defs
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"{SCHEMA}: {len(defs)} definitions written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
