"""numaPools in the chart: the admission policy checks the resources the plugin makes from it
(<name>-numa<N>, <name>-local), whose NUMA numbers the chart cannot know, by pattern; evaluated with
cel-python on the rendered policy, as the other policy tests do."""

from __future__ import annotations

import pytest
from test_policy_cel import Policy, _hostnetwork_denied, _ipc_lock_denied, rdma_pod

SPLIT = {"numaPools": True, "extraResources": [{"name": "rdma.example.com/ib", "numaPools": True}, {"name": "rdma/x"}]}


@pytest.fixture(scope="module")
def split() -> Policy:
    return Policy(SPLIT)


@pytest.mark.parametrize("resource", ["rdma/hca-local", "rdma/hca-numa0", "rdma/hca-numa13", "rdma.example.com/ib-local"])
def test_split_resources_are_checked_like_the_configured_ones(split: Policy, resource: str) -> None:
    assert _hostnetwork_denied(split.evaluate(rdma_pod(host_network=False, resource=resource)))
    assert _ipc_lock_denied(split.evaluate(rdma_pod(caps=[], resource=resource)))
    assert split.evaluate(rdma_pod(resource=resource)) == []  # hostNetwork and IPC_LOCK: allowed


@pytest.mark.parametrize(
    "resource",
    [
        "rdma/x-local",  # its pool is not split
        "rdma/hca-numa",  # no node number
        "rdma/hca-numa0x",
        "rdmaXexample.com/ib-local",  # "." is a dot, not any character
        "other/hca-local",
    ],
)
def test_names_numa_pools_do_not_make_are_not_matched(split: Policy, resource: str) -> None:
    assert split.evaluate(rdma_pod(host_network=False, resource=resource)) is None


def test_without_numa_pools_the_split_names_are_not_the_plugins() -> None:
    assert Policy({}).evaluate(rdma_pod(host_network=False, resource="rdma/hca-local")) is None


def test_a_zero_request_of_a_split_resource_is_no_request(split: Policy) -> None:
    pod = rdma_pod(host_network=False, resource="rdma/hca-numa1")
    pod["spec"]["containers"][0]["resources"]["limits"]["rdma/hca-numa1"] = 0
    assert split.evaluate(pod) is None


def test_the_messages_name_the_split_resources(split: Policy) -> None:
    [message] = split.evaluate(rdma_pod(host_network=False, resource="rdma/hca-local")) or []
    assert "rdma/hca-numa<N>, rdma/hca-local" in message
