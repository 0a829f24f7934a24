#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Validate Helm chart values against the chart's own values.schema.json (and its templates)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_chart_values
short_description: Validate chart values against the chart's values.schema.json, naming the inventory variables
description:
  - Checks O(values) against the JSON schema the chart ships (C(values.schema.json)), with the real Helm
    engine (C(helm_python)) when it is importable, else with C(jsonschema) (draft 2020-12).
  - Every schema error is reported with the inventory variable that produced the value (from O(variables)),
    the chart value path, the value and the schema's complaint; all errors in one failure.
  - With O(render_check), also renders the chart once (Helm engine only) so that the chart's own
    combination checks (a C(fail) in its templates) are reported before anything touches a cluster.
  - Never changes anything; supports check mode.
version_added: "0.1.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_release]
options:
  variables:
    description:
      - Maps a chart value path (JSON pointer, e.g. C(/sharedDevices), C(/nonHostNetwork/enabled)) to the
        inventory variable that sets it. The longest matching prefix names the variable in messages.
    type: dict
    default: {}
  render_check:
    description: Also render the chart with the values (Helm engine only) to run its template checks.
    type: bool
    default: true
"""

EXAMPLES = r"""
- name: Validate the chart values
  rdma_chart_values:
    chart_path: "{{ playbook_dir }}/../charts/rdma-device-plugin"
    values: "{{ plugin_deploy_values }}"
    variables:
      /sharedDevices: rdma_shared_devices
      /mode: rdma_mode
  delegate_to: localhost
"""

RETURN = r"""
engine:
  description: Which validator ran (C(helm) or C(jsonschema)).
  type: str
  returned: always
errors:
  description: One entry per problem (path, variable, value, message); empty when the values are valid.
  type: list
  elements: dict
  returned: always
"""

import json
import os
import re

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_helm import RELEASE_ARGS, render

_HELM_ERROR = re.compile(r"at '([^']*)': (.*)")


def _pointer_get(values, pointer):
    cur = values
    for part in [p for p in pointer.split("/") if p]:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _variable_for(pointer, variables):
    best = None
    for prefix in variables:
        norm = "/" + prefix.strip("/")
        if pointer == norm or pointer.startswith(norm + "/") or norm == "/":
            if best is None or len(norm) > len("/" + best.strip("/")):
                best = prefix
    return variables.get(best) if best is not None else None


def _helm_errors(chart_path, values):
    import helm_python

    chart = helm_python.Chart.load(chart_path)
    try:
        chart.validate_schema(values)
    except helm_python.HelmError as exc:
        text = str(exc)
        found = [(m.group(1), m.group(2).strip()) for m in _HELM_ERROR.finditer(text)]
        return chart, found or [("", text.strip())]
    return chart, []


def _jsonschema_errors(chart_path, values):
    import jsonschema
    import yaml

    with open(os.path.join(chart_path, "values.schema.json"), encoding="utf-8") as fh:
        schema = json.load(fh)
    with open(os.path.join(chart_path, "values.yaml"), encoding="utf-8") as fh:
        merged = _merge(yaml.safe_load(fh) or {}, values)
    validator = jsonschema.Draft202012Validator(schema)
    out = []
    for err in sorted(validator.iter_errors(merged), key=lambda e: list(e.absolute_path)):
        out.append(("/" + "/".join(str(p) for p in err.absolute_path), err.message))
    return out


def _merge(base, over):
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, val in over.items():
            merged[key] = _merge(base.get(key), val) if key in base else val
        return merged
    return over


def main():
    module = AnsibleModule(
        argument_spec=dict(
            RELEASE_ARGS,
            variables=dict(type="dict", default={}),
            render_check=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    chart_path, values, variables = p["chart_path"], p["values"], p["variables"]
    if not os.path.isfile(os.path.join(chart_path, "values.schema.json")):
        module.fail_json(msg=f"no values.schema.json in chart directory {chart_path}")

    chart = None
    try:
        chart, raw = _helm_errors(chart_path, values)
        engine = "helm"
    except ImportError:
        raw = _jsonschema_errors(chart_path, values)
        engine = "jsonschema"

    errors = []
    for pointer, message in raw:
        errors.append(
            {
                "path": pointer,
                "variable": _variable_for(pointer, variables),
                "value": _pointer_get(values, pointer),
                "message": message,
            }
        )
    if errors:
        lines = []
        for e in errors:
            who = f"inventory variable {e['variable']}" if e["variable"] else "a chart value not set from the inventory"
            value = json.dumps(e["value"]) if e["value"] is not None else "(unset)"
            lines.append(f"{who} (chart value {e['path'] or '/'} = {value}): {e['message']}")
        module.fail_json(
            msg=(
                f"The chart values rendered from the inventory do not match {chart_path}/values.schema.json; "
                "fix these inventory variables: " + "; ".join(lines)
            ),
            errors=errors,
            engine=engine,
        )

    if p["render_check"] and chart is not None:
        import helm_python

        try:
            render(chart, values, p["release_name"], p["namespace"], p["kube_version"])
        except helm_python.HelmError as exc:
            module.fail_json(
                msg=f"The chart's own checks reject the values rendered from the inventory: {exc}",
                errors=[{"path": "", "variable": None, "value": None, "message": str(exc)}],
                engine=engine,
            )
    module.exit_json(changed=False, engine=engine, errors=[])


if __name__ == "__main__":
    main()
