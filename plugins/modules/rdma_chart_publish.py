#!/usr/bin/python
# -*- coding: utf-8 -*-
"""Package the Helm chart (the real Helm engine) and push it to an OCI registry as Helm does."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: rdma_chart_publish
short_description: Publish the Helm chart as an OCI artifact next to the plugin image
description:
  - Packages the chart as C(helm package) does (the real Helm engine embedded in C(helm_python)), then pushes
    it with the C(oras) OCI client to C(<registry>/<repository>/<chart name>:<chart version>) with Helm's media
    types (config C(application/vnd.cncf.helm.config.v1+json) holding Chart.yaml as JSON, one layer
    C(application/vnd.cncf.helm.chart.content.v1.tar+gzip)) and the manifest annotations C(helm push) writes,
    so C(helm pull oci://...) and C(helm install oci://...) take it.
  - The manifest also carries a hash of the chart's files (C(io.lingjun.rdma.chart-content-hash)); a second
    run with the same chart pushes nothing (changed=false); the same version with other content fails, since a
    published chart version must never change (bump the version, see the chart's CHANGELOG).
  - Check mode reports whether a push would happen.
version_added: "0.2.0"
author: rdma-device-plugin maintainers
extends_documentation_fragment: [lingjun.rdma.rdma_registry_auth]
options:
  chart_path:
    description: Directory of the chart.
    type: path
    required: true
  registry:
    description: Registry host[:port].
    type: str
    required: true
  repository:
    description: Path in the registry under which the chart goes (the chart name is appended, as helm push does).
    type: str
    default: charts
  tls_verify:
    description: Verify the registry's TLS certificate; false also talks plain HTTP (a local registry).
    type: bool
    default: true
"""

EXAMPLES = r"""
- name: Publish the chart next to the image
  rdma_chart_publish:
    chart_path: charts/rdma-device-plugin
    registry: 127.0.0.1:5000
    repository: charts
    tls_verify: false
"""

RETURN = r"""
ref:
  description: The chart reference to install from, C(oci://<registry>/<repository>/<name>:<version>).
  type: str
  returned: always
digest:
  description: Manifest digest in the registry (C(sha256:...)).
  type: str
  returned: unless check mode would push
version:
  description: Chart version (the tag).
  type: str
  returned: always
content_hash:
  description: sha256 over the packaged chart's files (names and contents, not their times).
  type: str
  returned: always
"""

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.lingjun.rdma.plugins.module_utils.rdma_helm import REGISTRY_AUTH_ARGS

# Helm's OCI media types (helm.sh/helm pkg/registry/constants.go).
CONFIG_MEDIA_TYPE = "application/vnd.cncf.helm.config.v1+json"
CHART_LAYER_MEDIA_TYPE = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"
CONTENT_HASH_ANNOTATION = "io.lingjun.rdma.chart-content-hash"


def content_hash(tgz):
    """sha256 over the archive's member names and contents: helm package stamps each member with the
    time of packaging, so the archive's own digest changes at every run while this does not."""
    digest = hashlib.sha256()
    with tarfile.open(tgz, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if not member.isfile():
                continue
            data = tar.extractfile(member).read()
            digest.update(member.name.encode() + b"\0" + hashlib.sha256(data).hexdigest().encode() + b"\n")
    return digest.hexdigest()


def package(chart_path, destination):
    """helm package: the archive path and the chart's metadata (Chart.yaml as Helm reads it)."""
    import helm_python

    tgz = helm_python.package(chart_path, destination=destination)
    with open(tgz, "rb") as fh:
        chart = helm_python.Chart.load_archive(fh.read())
    return tgz, dict(chart.metadata)


def manifest_annotations(metadata, digest):
    """What helm push writes (pkg/registry generateOCIAnnotations): the chart's own annotations, then the
    OCI ones from Chart.yaml; plus the content hash this module compares."""
    annotations = {k: str(v) for k, v in (metadata.get("annotations") or {}).items()}
    oci = {
        "org.opencontainers.image.title": metadata["name"],
        "org.opencontainers.image.version": metadata["version"],
        "org.opencontainers.image.description": metadata.get("description", ""),
        "org.opencontainers.image.url": metadata.get("home", ""),
        "org.opencontainers.image.source": (metadata.get("sources") or [""])[0],
        "org.opencontainers.image.created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    maintainers = metadata.get("maintainers") or []
    if maintainers:
        oci["org.opencontainers.image.authors"] = ", ".join(
            m["name"] + (f" ({m['email']})" if m.get("email") else "") for m in maintainers
        )
    annotations.update({k: v for k, v in oci.items() if v})
    annotations[CONTENT_HASH_ANNOTATION] = digest
    return annotations


def auth_scheme(registry, tls_verify):
    """"basic" or "bearer": what the registry's /v2/ asks for (an htpasswd registry wants Basic on every
    request, a token registry a Bearer token obtained with Basic credentials)."""
    import requests

    scheme = "http" if not tls_verify else "https"
    response = requests.get(f"{scheme}://{registry}/v2/", timeout=10, verify=tls_verify)
    header = response.headers.get("Www-Authenticate", "")
    return "basic" if header.lower().startswith("basic") else "bearer"


def client(registry, tls_verify, username, password):
    import oras.client

    backend = "basic" if username and auth_scheme(registry, tls_verify) == "basic" else "token"
    oras_client = oras.client.OrasClient(
        hostname=registry, insecure=not tls_verify, tls_verify=tls_verify, auth_backend=backend
    )
    if username:
        # Credentials for this client only: oras' login() would also write ~/.docker/config.json.
        oras_client.auth.set_basic_auth(username, password)
    return oras_client


def published_hash(oras_client, target):
    """The content hash of what the registry holds under target, "" when the tag does not exist."""
    import requests

    try:
        manifest = oras_client.get_manifest(target)
    except (ValueError, requests.HTTPError) as exc:  # oras raises ValueError for a 404
        if "404" in str(exc) or "not found" in str(exc).lower() or "MANIFEST_UNKNOWN" in str(exc):
            return ""
        raise
    return (manifest.get("annotations") or {}).get(CONTENT_HASH_ANNOTATION, "unknown")


def push(oras_client, target, tgz, metadata, digest, workdir):
    """Push with Helm's media types; returns the manifest digest."""
    config = os.path.join(workdir, "config.json")
    with open(config, "w", encoding="utf-8") as fh:
        json.dump(metadata, fh, separators=(",", ":"))
    response = oras_client.push(
        target=target,
        files=[f"{tgz}:{CHART_LAYER_MEDIA_TYPE}"],
        manifest_config=f"{config}:{CONFIG_MEDIA_TYPE}",
        manifest_annotations=manifest_annotations(metadata, digest),
        disable_path_validation=True,
        quiet=True,
    )
    return response.headers.get("Docker-Content-Digest", "")


def main():
    module = AnsibleModule(
        argument_spec=dict(
            REGISTRY_AUTH_ARGS,
            chart_path=dict(type="path", required=True),
            registry=dict(type="str", required=True),
            repository=dict(type="str", default="charts"),
            tls_verify=dict(type="bool", default=True),
        ),
        supports_check_mode=True,
    )
    p = module.params
    try:
        import helm_python  # noqa: F401
        import oras.client  # noqa: F401
    except ImportError as exc:
        module.fail_json(msg=f"publishing the chart needs helm_python (pip install helm-python-sdk) and oras (pip install oras): {exc}")
    workdir = tempfile.mkdtemp(prefix="rdma-chart-publish-")
    try:
        try:
            tgz, metadata = package(p["chart_path"], workdir)
        except Exception as exc:  # the Helm engine's errors name the chart problem
            module.fail_json(msg=f"helm package {p['chart_path']} failed: {exc}")
        digest = content_hash(tgz)
        name, version = metadata["name"], metadata["version"]
        tag = version.replace("+", "_")  # as helm push: "+" is not allowed in an OCI tag
        target = f"{p['registry']}/{p['repository'].strip('/')}/{name}:{tag}"
        result = dict(ref=f"oci://{target}", version=version, content_hash=digest, changed=False)
        try:
            oras_client = client(p["registry"], p["tls_verify"], p["username"], p["password"])
            held = published_hash(oras_client, target)
        except Exception as exc:
            module.fail_json(
                msg=f"cannot read {target} from registry {p['registry']}: {exc}; check the registry address, "
                "plugin_image_tls_verify (false for a plain-HTTP registry) and the credentials",
                **result,
            )
        if held == digest:
            module.exit_json(**result)
        if held:
            module.fail_json(
                msg=f"chart {name} {version} is already published at oci://{target} with other content "
                f"(content hash {held[:12]}, this chart {digest[:12]}): a published version never changes; bump "
                "version in Chart.yaml and add its CHANGELOG entry (charts/rdma-device-plugin/CHANGELOG.md)",
                **result,
            )
        result["changed"] = True
        if module.check_mode:
            module.exit_json(**result)
        try:
            result["digest"] = push(oras_client, target, tgz, metadata, digest, workdir)
        except Exception as exc:
            module.fail_json(msg=f"pushing the chart to {target} failed: {exc}", **result)
        module.exit_json(**result)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
