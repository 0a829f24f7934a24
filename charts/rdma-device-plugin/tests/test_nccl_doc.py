"""docs/nccl.md: its Jobs and Services are valid Kubernetes objects (strict schemas, oldest and newest
minor the chart supports), and the chart's own admission policy admits each Job's pods in the mode
the doc says (hostNetwork with the defaults, the pod-network Job with nonHostNetwork.enabled)."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import CASES, CHART_DIR, kube_minor_versions
from test_policy_cel import Policy, pod_of_job
from test_tenant_policy import Tenant

DOC = CHART_DIR.parents[1] / "docs" / "nccl.md"


def _objects() -> dict[str, dict[str, Any]]:
    text = DOC.read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```yaml\n")[1:]]
    objs = [o for b in blocks for o in yaml.safe_load_all(b) if isinstance(o, dict) and "kind" in o]
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


OBJECTS = _objects()


def test_the_doc_has_a_job_and_service_per_mode() -> None:
    assert sorted(OBJECTS) == [
        "Job/nccl-hostnetwork",
        "Job/nccl-podnetwork",
        "Service/nccl-hostnetwork",
        "Service/nccl-podnetwork",
    ]
    for mode in ("hostnetwork", "podnetwork"):
        job, svc = OBJECTS[f"Job/nccl-{mode}"], OBJECTS[f"Service/nccl-{mode}"]
        pod = job["spec"]["template"]["spec"]
        assert pod["subdomain"] == svc["metadata"]["name"]  # the rendezvous name resolves
        assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
        assert f"--master-addr={job['metadata']['name']}-0.{svc['metadata']['name']}" in (
            pod["containers"][0]["command"][-1]
        )
        assert pod["containers"][0]["resources"]["limits"]["rdma/hca"] == 1


@pytest.mark.parametrize("name", sorted(OBJECTS))
def test_objects_are_valid(name: str) -> None:
    for version in (kube_minor_versions()[0], kube_minor_versions()[-1]):
        kubernetes_validate.validate(OBJECTS[name], version, strict=True)


def test_admission_policy_admits_each_job_in_its_mode() -> None:
    defaults, switch_on = Policy({}), Policy(CASES["non-hostnetwork"])
    host = pod_of_job(OBJECTS["Job/nccl-hostnetwork"])
    pod_network = pod_of_job(OBJECTS["Job/nccl-podnetwork"])
    assert defaults.evaluate(host) == []
    assert switch_on.evaluate(pod_network) == []
    assert defaults.evaluate(pod_network)  # refused with the defaults: the doc says it needs the switch
    # and the tenant policy admits both in a namespace that allows RDMA (the doc says to label it)
    tenant = {"rdma.lingjun.io/tenant": "true"}
    assert Tenant({}).evaluate(host, namespace_labels=tenant) == []
    assert Tenant(CASES["non-hostnetwork"]).evaluate(pod_network, namespace_labels=tenant) == []
