"""A stub GPU DRA driver (``gpu.example.com``) for the alignment tests: one device per NVIDIA GPU of a
fixture node, with the standard attributes a GPU driver publishes (``resource.kubernetes.io/pcieRoot``,
``pciBusID``, ``numaNode``: NVIDIA's DRA driver publishes the first two from the same sysfs reads),
published as a ResourceSlice and served to the kubelet over the real DRA gRPC and plugin registration
(the RDMA driver's own :mod:`rdma_device_plugin.dra.service` and :mod:`~rdma_device_plugin.dra.publisher`).

It differs from a GPU driver in what the tests do not need: prepare hands out no CDI device (the
GPU is only allocated), no health, no sharing, no config.
"""

from __future__ import annotations

from typing import Any

from rdma_device_plugin.dra import kubeapi
from rdma_device_plugin.dra.claims import PreparedDevice
from rdma_device_plugin.dra.model import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT
from rdma_device_plugin.dra.publisher import Publisher
from rdma_device_plugin.dra.service import HealthFeed, KubeletService, Paths
from rdma_node import pcie

DRIVER = "gpu.example.com"


def gpu_devices(sysfs_root: str) -> list[dict[str, Any]]:
    out = []
    for i, gpu in enumerate(sorted(pcie.read_gpus(sysfs_root), key=lambda g: g.address)):
        attrs: dict[str, Any] = {PCI_BUS_ID: {"string": gpu.address}, "index": {"int": i}}
        if gpu.path:
            attrs[PCIE_ROOT] = {"string": gpu.path[0]}
        if gpu.numa_node is not None:
            attrs[NUMA_NODE] = {"int": gpu.numa_node}
        out.append({"name": f"gpu-{i}", "attributes": attrs})
    return out


class _Backend:
    def __init__(self, client: kubeapi.Client, node: str) -> None:
        self.client = client
        self.node = node
        self.prepared: dict[str, list[PreparedDevice]] = {}

    def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        claim = self.client.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
        results = claim["status"]["allocation"]["devices"]["results"]
        out = [
            PreparedDevice([r["request"].split("/")[0]], r["pool"], r["device"], [])
            for r in results
            if r["driver"] == DRIVER and r["pool"] == self.node
        ]
        self.prepared[uid] = out
        return out

    def unprepare(self, namespace: str, uid: str, name: str) -> None:
        self.prepared.pop(uid, None)


class GpuDraStub:
    def __init__(self, client: kubeapi.Client, node: str, kubelet_dir: str, sysfs_root: str) -> None:
        self.devices = gpu_devices(sysfs_root)
        self.backend = _Backend(client, node)
        self.publisher = Publisher(client, DRIVER, node, resync=5.0)
        spec = {"driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 1, "resourceSliceCount": 1}}
        self.publisher.set_specs({"devices": {**spec, "devices": self.devices}})
        self.service = KubeletService(DRIVER, Paths.of(kubelet_dir, DRIVER, "stub"), self.backend, HealthFeed())

    def start(self) -> GpuDraStub:
        self.publisher.start()
        self.service.start()
        return self

    def stop(self) -> None:
        self.service.stop()
        self.publisher.stop()
