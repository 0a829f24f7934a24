#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Render a Helm chart with the real Helm engine into a directory; extract the plugin config of one mode."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_chart_render
short_description: Render the chart with the Helm engine (helm_python) into manifest files
description:
  - Renders the chart as C(helm template) would (real Helm v4 engine embedded in C(helm_python)) and writes
    one file per template into O(dest); files are only rewritten when their content changes, and C(.yaml)
    files of templates that no longer render are removed.
  - Extracts the plugin config file of O(config_mode) from the rendered ConfigMap (the one labelled
    C(<mode_label_key>=<config_mode>)) and writes it to O(config_dest).
  - Supports check mode (reports what would change).
version_added: "0.1.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_release]
options:
  dest:
    description: Directory for the rendered manifests (created).
    type: path
    required: true
  config_mode:
    description: Mode (shared or exclusive) whose plugin config to extract; none to skip.
    type: str
    choices: [shared, exclusive]
  config_dest:
    description: File to write the extracted plugin config to (needs O(config_mode)).
    type: path
  mode_label_key:
    description: Label key that marks the ConfigMap of each mode.
    type: str
    default: rdma.lingjun.io/mode
"""

EXAMPLES = r"""
- name: Render the chart
  rdma_chart_render:
    chart_path: charts/rdma-device-plugin
    values: {mode: shared}
    dest: out/local/manifests
    config_mode: shared
    config_dest: out/local/config.yaml
"""

RETURN = r"""
files:
  description: The manifest files written (or unchanged) in O(dest).
  type: list
  elements: str
  returned: always
changed_files:
  description: Files created, rewritten or removed.
  type: list
  elements: str
  returned: always
config:
  description: The extracted plugin config (parsed), when O(config_mode) is set.
  type: dict
  returned: when config_mode is set
"""

import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_helm import RELEASE_ARGS, render


def _write(path, text, check_mode):
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return False
    except OSError:
        pass
    if not check_mode:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    return True


def main():
    module = AnsibleModule(
        argument_spec=dict(
            RELEASE_ARGS,
            dest=dict(type="path", required=True),
            config_mode=dict(type="str", choices=["shared", "exclusive"]),
            config_dest=dict(type="path"),
            mode_label_key=dict(type="str", default="rdma.lingjun.io/mode"),
        ),
        required_by={"config_dest": ["config_mode"]},
        supports_check_mode=True,
    )
    p = module.params
    try:
        import helm_python
        import yaml
    except ImportError as exc:
        module.fail_json(msg=f"rendering needs helm_python (pip install helm-python-sdk) and PyYAML: {exc}")

    chart = helm_python.Chart.load(p["chart_path"])
    try:
        rendered = render(chart, p["values"], p["release_name"], p["namespace"], p["kube_version"])
    except helm_python.HelmError as exc:
        module.fail_json(msg=f"helm template failed: {exc}")

    dest = p["dest"]
    if not module.check_mode:
        os.makedirs(dest, exist_ok=True)
    files, changed_files, docs = [], [], []
    for key in sorted(rendered):
        text = rendered[key]
        rel = key.split("/templates/", 1)[-1]
        if not rel.endswith((".yaml", ".yml")) or not text.strip():
            continue
        for doc in yaml.safe_load_all(text):
            if isinstance(doc, dict):
                docs.append(doc)
        name = rel.replace("/", "_")
        path = os.path.join(dest, name)
        files.append(path)
        if _write(path, text if text.endswith("\n") else text + "\n", module.check_mode):
            changed_files.append(path)
    if os.path.isdir(dest):
        for entry in sorted(os.listdir(dest)):
            path = os.path.join(dest, entry)
            if entry.endswith(".yaml") and path not in files:
                changed_files.append(path)
                if not module.check_mode:
                    os.unlink(path)

    result = {"files": files}
    if p["config_mode"]:
        config_text = None
        for doc in docs:
            labels = (doc.get("metadata") or {}).get("labels") or {}
            if doc.get("kind") == "ConfigMap" and labels.get(p["mode_label_key"]) == p["config_mode"]:
                config_text = (doc.get("data") or {}).get("config.yaml")
        if config_text is None:
            module.fail_json(
                msg=f"the rendered chart has no ConfigMap labelled {p['mode_label_key']}={p['config_mode']} "
                "with data config.yaml",
                files=files,
            )
        result["config"] = yaml.safe_load(config_text)
        if p["config_dest"]:
            parent = os.path.dirname(p["config_dest"])
            if parent and not module.check_mode:
                os.makedirs(parent, exist_ok=True)
            if _write(p["config_dest"], config_text, module.check_mode):
                changed_files.append(p["config_dest"])
    module.exit_json(changed=bool(changed_files), changed_files=changed_files, **result)


if __name__ == "__main__":
    main()
