#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Resolve a chart reference: a directory as is, an oci:// reference pulled into a cache directory."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_chart_pull
short_description: Resolve a chart reference (a directory, or oci://host/path/name:version) to a chart directory
description:
  - A chart directory is returned as is.
  - An C(oci://<registry>/<path>/<chart>:<version>) reference (what the plugin_image role publishes, or
    C(helm push) writes) is pulled with the real Helm engine (C(helm_python)) and unpacked into
    O(cache_dir)C(/<registry>/<path>/<chart>/<version>/); a version already there is not pulled again. Without a
    version Helm takes the highest semver tag.
  - Read-only towards the cluster; runs in check mode too (the cache is only a copy of the registry).
version_added: "0.2.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_registry_auth]
options:
  chart:
    description: A chart directory, or an C(oci://) reference.
    type: str
    required: true
  cache_dir:
    description: Where pulled charts are unpacked.
    type: path
    default: ~/.cache/rdma-device-plugin/charts
  digest:
    description:
      - The digest (C(sha256:<64 hex>)) an C(oci://) chart must have. It is pulled by that digest (Helm checks it
        against the registry's) and cached under it. Empty means the version is trusted. Ignored for a directory.
    type: str
    default: ""
  plain_http:
    description:
      - Talk plain HTTP to the registry. C(auto) does so for a loopback registry (127.0.0.0/8, localhost, [::1])
        and HTTPS for any other.
    type: str
    choices: [auto, "true", "false"]
    default: auto
"""

EXAMPLES = r"""
- name: Resolve the chart (pulls an oci:// reference)
  rdma_chart_pull:
    chart: oci://127.0.0.1:5000/charts/rdma-device-plugin:1.0.0
  register: chart
"""

RETURN = r"""
chart_path:
  description: The chart directory to render or install.
  type: str
  returned: always
version:
  description: The chart's version (from its Chart.yaml).
  type: str
  returned: always
app_version:
  description: The chart's appVersion (from its Chart.yaml), the image tag its default values stand for.
  type: str
  returned: always
pulled:
  description: Whether the chart was downloaded by this run.
  type: bool
  returned: always
"""

import os
import re
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_helm import REGISTRY_AUTH_ARGS

OCI = re.compile(r"^oci://(?P<registry>[^/]+)/(?P<path>(?:[^/:@]+/)*)(?P<name>[^/:@]+)(?::(?P<version>[^/:@]+))?$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?$")


def parse(ref):
    """(registry, path, name, version or None) of an oci:// reference; None for anything else."""
    match = OCI.match(ref)
    if not match:
        return None
    return match["registry"], match["path"].strip("/"), match["name"], match["version"]


def chart_version(chart_dir):
    import helm_python

    return str(helm_python.Chart.load(chart_dir).version)


def chart_app_version(chart_dir):
    import helm_python

    return str(helm_python.Chart.load(chart_dir).metadata.get("appVersion") or "")


def pull(ref, cache_dir, plain_http, username="", password="", digest=""):
    """The chart directory of an oci:// reference, pulled into the cache unless it is there; (dir, pulled).
    With a digest the chart is pulled by it (Helm refuses a tag naming another) and cached under it, so a
    version cached from an earlier pull is never taken for it."""
    import helm_python

    registry, path, name, version = parse(ref)
    base = os.path.join(cache_dir, registry.replace(":", "_"), path, name)
    if digest:
        cached = os.path.join(base, digest.replace(":", "_"), name)
        if os.path.isfile(os.path.join(cached, "Chart.yaml")):
            return cached, False
    elif version:
        cached = os.path.join(base, version.replace("_", "+"), name)
        if os.path.isfile(os.path.join(cached, "Chart.yaml")):
            return cached, False
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".pull-", dir=base)
    repo = f"oci://{registry}/{path + '/' if path else ''}{name}"
    try:
        helm_python.pull(
            # Helm compares a reference's digest with the one the registry serves for its tag
            f"{repo}{':' + version.replace('_', '+') if version and digest else ''}{'@' + digest if digest else ''}",
            version=version.replace("_", "+") if version and not digest else None,
            destination=work,
            untar=True,
            untar_dir=work,
            plain_http=plain_http,
            username=username or None,
            password=password or None,
        )
        got = chart_version(os.path.join(work, name))
        dest = os.path.join(base, digest.replace(":", "_") if digest else got)
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        os.makedirs(dest)
        os.rename(os.path.join(work, name), os.path.join(dest, name))
        return os.path.join(dest, name), True
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main():
    module = AnsibleModule(
        argument_spec=dict(
            REGISTRY_AUTH_ARGS,
            chart=dict(type="str", required=True),
            cache_dir=dict(type="path", default="~/.cache/rdma-device-plugin/charts"),
            plain_http=dict(type="str", choices=["auto", "true", "false"], default="auto"),
            digest=dict(type="str", default=""),
        ),
        supports_check_mode=True,
    )
    p = module.params
    ref = p["chart"]
    try:
        import helm_python  # noqa: F401
    except ImportError as exc:
        module.fail_json(msg=f"resolving the chart needs helm_python (pip install helm-python-sdk): {exc}")
    if ref.startswith("oci://"):
        parts = parse(ref)
        if parts is None:
            module.fail_json(msg=f"chart {ref!r} is not an OCI chart reference; use oci://<registry>/<path>/<chart>:<version>")
        plain = p["plain_http"] == "true" or (p["plain_http"] == "auto" and bool(LOOPBACK.match(parts[0])))
        digest = p["digest"]
        if digest and not DIGEST.match(digest):
            module.fail_json(msg=f"digest {digest!r} is not a chart digest; use sha256:<64 hex>, as helm push prints it")
        try:
            chart_dir, pulled = pull(ref, p["cache_dir"], plain, p["username"], p["password"], digest)
        except Exception as exc:  # the Helm engine's errors say what the registry answered
            mismatch = "digest mismatch" in str(exc) or (digest and "not found" in str(exc))
            module.fail_json(
                mismatch=bool(mismatch),
                msg=f"cannot pull chart {ref}{'@' + digest if digest else ''}: {exc}; "
                + (
                    "the registry serves other content than the digest it must have"
                    if mismatch
                    else "check the reference (oci://<registry>/<path>/<chart>:<version>), "
                    "that the registry serves it, and plain HTTP versus HTTPS (plain_http)"
                ),
            )
        module.exit_json(
            changed=False,
            chart_path=chart_dir,
            version=chart_version(chart_dir),
            app_version=chart_app_version(chart_dir),
            pulled=pulled,
        )
    chart_dir = os.path.abspath(os.path.expanduser(ref))
    if not os.path.isfile(os.path.join(chart_dir, "Chart.yaml")):
        module.fail_json(msg=f"chart {ref!r} is neither a chart directory (no Chart.yaml there) nor an oci:// reference")
    module.exit_json(
        changed=False,
        chart_path=chart_dir,
        version=chart_version(chart_dir),
        app_version=chart_app_version(chart_dir),
        pulled=False,
    )


if __name__ == "__main__":
    main()
