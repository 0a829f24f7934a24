#!/usr/bin/python
# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Ansible module: helm upgrade --install or helm uninstall of one release, Helm 3.8+ and Helm 4 alike."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_helm_release
short_description: Install, upgrade or uninstall one Helm release with the helm CLI (Helm 3.8 or later, Helm 4)
description:
  - Runs the helm binary on the controller. With O(state=present), C(helm upgrade --install) with
    O(values), unless the release is deployed already with this chart version and exactly these
    values (then nothing changes). With O(state=absent), C(helm uninstall) when the release exists.
  - The release is read with C(helm history --max 1) and C(helm get values), which Helm 3 and Helm 4
    answer alike (kubernetes.core.helm lists releases with C(helm list --all), a flag Helm 4 removed;
    its later versions refuse Helm 4).
  - In check mode only the reads run; the result says what would be done.
version_added: "1.2.0"
author: rdma-device-plugin maintainers
options:
  binary: {description: The helm binary (a name on PATH or a path)., type: str, default: helm}
  name: {description: The release name., type: str, required: true}
  namespace: {description: The release namespace (an install creates it)., type: str, required: true}
  state: {description: Whether the release is installed., type: str, choices: [present, absent], default: present}
  chart_path: {description: The chart directory (O(state=present))., type: path}
  values: {description: The release's values (O(state=present))., type: dict, default: {}}
  wait: {description: Wait until the release's resources are ready (helm --wait)., type: bool, default: false}
  timeout: {description: "helm --timeout with O(wait) (e.g. C(330s)); empty is helm's default.", type: str, default: ""}
  kubeconfig: {description: Kubeconfig of the cluster; empty is helm's default., type: str, default: ""}
  context: {description: Kubeconfig context; empty is the current one., type: str, default: ""}
"""

EXAMPLES = r"""
- name: Install or upgrade release rdma
  lingjun.rdma.rdma_helm_release:
    name: rdma
    namespace: kube-system
    chart_path: charts/rdma-device-plugin
    values: {mode: shared}
"""

RETURN = r"""
msg: {description: What was done (or would be done in check mode)., returned: always, type: str}
revision: {description: The release's revision after the run (0 when it does not exist)., returned: always, type: int}
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule


class Helm(object):
    def __init__(self, module):
        self.m = module
        p = module.params
        self.name, self.namespace = p["name"], p["namespace"]
        self.flags = ["--namespace", self.namespace]
        if p["kubeconfig"]:
            self.flags += ["--kubeconfig", p["kubeconfig"]]
        if p["context"]:
            self.flags += ["--kube-context", p["context"]]

    def run(self, args, check=True):
        argv = [self.m.params["binary"]] + args + self.flags
        rc, out, err = self.m.run_command(argv)
        if rc != 0 and check:
            self.m.fail_json(
                msg="helm %s of release %s (namespace %s) failed (rc %d): %s"
                % (args[0], self.name, self.namespace, rc, (err or out).strip()),
                cmd=" ".join(argv),
            )
        return rc, out, err

    def current(self):
        """The latest revision ({revision, status, chart, ...}), None when the release does not exist."""
        rc, out, err = self.run(["history", self.name, "--max", "1", "--output", "json"], check=False)
        if rc != 0:
            if "not found" in err:
                return None
            self.run(["history", self.name, "--max", "1", "--output", "json"])  # fails with helm's message
        history = json.loads(out or "[]")
        return history[-1] if history else None

    def values(self):
        return json.loads(self.run(["get", "values", self.name, "--output", "json"])[1] or "null") or {}


def chart_ref(path):
    """name-version of the chart directory, as helm history shows it."""
    import yaml

    with open(os.path.join(path, "Chart.yaml")) as f:
        meta = yaml.safe_load(f)
    return "%s-%s" % (meta["name"], meta["version"])


def main():
    module = AnsibleModule(
        argument_spec=dict(
            binary={"type": "str", "default": "helm"},
            name={"type": "str", "required": True},
            namespace={"type": "str", "required": True},
            state={"type": "str", "choices": ["present", "absent"], "default": "present"},
            chart_path={"type": "path"},
            values={"type": "dict", "default": {}},
            wait={"type": "bool", "default": False},
            timeout={"type": "str", "default": ""},
            kubeconfig={"type": "str", "default": ""},
            context={"type": "str", "default": ""},
        ),
        required_if=[("state", "present", ["chart_path"])],
        supports_check_mode=True,
    )
    p = module.params
    helm = Helm(module)
    where = "release %s (namespace %s)" % (p["name"], p["namespace"])
    wait = (["--wait"] + (["--timeout", p["timeout"]] if p["timeout"] else [])) if p["wait"] else []
    try:
        release = helm.current()
    except OSError as err:  # the binary itself
        module.fail_json(msg="cannot run helm '%s': %s" % (p["binary"], err))
    if p["state"] == "absent":
        if release is None:
            module.exit_json(changed=False, revision=0, msg="%s does not exist: nothing to remove" % where)
        if module.check_mode:
            module.exit_json(changed=True, revision=release["revision"], msg="would uninstall %s" % where)
        helm.run(["uninstall", p["name"]] + wait)
        module.exit_json(changed=True, revision=0, msg="uninstalled %s" % where)

    chart = chart_ref(p["chart_path"])
    wanted = json.loads(json.dumps(p["values"]))  # as helm returns them: JSON types
    if release is not None and release.get("status") == "deployed" and release.get("chart") == chart:
        if helm.values() == wanted:
            module.exit_json(
                changed=False,
                revision=release["revision"],
                msg="%s is deployed with chart %s and these values (revision %s): nothing to do"
                % (where, chart, release["revision"]),
            )
    verb = "install" if release is None else "upgrade"
    if module.check_mode:
        revision = release["revision"] if release else 0
        module.exit_json(changed=True, revision=revision, msg="would %s %s with chart %s" % (verb, where, chart))
    values_file = os.path.join(module.tmpdir, "values.json")  # JSON is YAML
    with open(values_file, "w") as f:
        json.dump(wanted, f)
    helm.run(["upgrade", "--install", p["name"], p["chart_path"], "--create-namespace", "--values", values_file] + wait)
    after = helm.current() or {}
    done = {"install": "installed", "upgrade": "upgraded"}[verb]
    module.exit_json(
        changed=True,
        revision=after.get("revision", 0),
        msg="%s %s with chart %s (revision %s, %s)" % (done, where, chart, after.get("revision"), after.get("status")),
    )

if __name__ == "__main__":
    main()
