"""Kubelets for tests, benchmarks and the local default: a development package of its own
(plugin_src/kubesim), never in the image and never imported by ``serve``.

- :class:`KubeletSimulator` (kubelet.py): the device manager re-written in Python, at least as strict
  as kubelets 1.28-1.34, with the fixed behaviour of kubernetes PR 135437 as an option.
- ``real.RealKubelet`` (real.py): the kubelet's own v1.32.10 device manager (``kubelet-dm-serve``).

Both offer the methods the tests use on either: ``start``, ``stop``, ``restart``,
``wait_registered``, ``wait_for``, ``wait_allocatable``, ``registration_count``, ``capacity``,
``allocatable``, ``node_status``, ``health``, ``numa``, ``options``, ``allocate``, ``release``,
``record_start``/``record_stop``.
"""

from rdma_device_plugin.kubeletapi import CHECKPOINT

from .kubelet import Allocation, AllocationFailed, Endpoint, KubeletSimulator

__all__ = ["CHECKPOINT", "Allocation", "AllocationFailed", "Endpoint", "KubeletSimulator"]
