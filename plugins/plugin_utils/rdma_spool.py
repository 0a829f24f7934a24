# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""The findings of one validate run, host by host, as the node reads finish: the spool.

Each node's read (the rdma_node_info action in playbooks/validate.yml, running in that host's worker)
writes the host's findings here and returns only a verdict; the report and the labels, once on the
controller, read them back from here. So the findings never pass through Ansible's result queue, its
registered variables or hostvars (a merge of every host's variables per reader), which cost the
controller per host what the node read itself costs.

The directory is under ansible-core's per-run local temporary directory (``DEFAULT_LOCAL_TMP``,
``~/.ansible/tmp/ansible-local-<pid>...``): made by ansible-playbook's main process before any worker
is forked, the same path in every worker of the run, private to it, removed when the run ends.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote, unquote

from ansible import constants as C

SUFFIX = ".json"


def directory():
    return os.path.join(C.DEFAULT_LOCAL_TMP, "rdma-validation")


def write(host, node_name, result):
    """Record ``host``'s findings (its rdma_validation fact, or {validated: false, errors} when it was not
    read) and its Kubernetes node name."""
    path = directory()
    os.makedirs(path, mode=0o700, exist_ok=True)
    partial = os.path.join(path, ".%s.%d" % (quote(host, safe=""), os.getpid()))
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump({"node_name": node_name, "result": result}, fh, default=str)
    os.replace(partial, os.path.join(path, quote(host, safe="") + SUFFIX))  # a reader sees all of it or none


def hosts():
    """The hosts recorded in this run (sorted)."""
    try:
        names = os.listdir(directory())
    except FileNotFoundError:
        return []
    return sorted(unquote(n[: -len(SUFFIX)]) for n in names if n.endswith(SUFFIX) and not n.startswith("."))


def read(host):
    """{node_name, result} of a recorded host."""
    with open(os.path.join(directory(), quote(host, safe="") + SUFFIX), encoding="utf-8") as fh:
        return json.load(fh)
