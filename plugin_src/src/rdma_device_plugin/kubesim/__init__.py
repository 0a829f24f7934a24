"""The kubelet stand-in (tests, benchmarks, the local default); never imported by ``serve``."""

from .kubelet import CHECKPOINT, Allocation, AllocationFailed, Endpoint, KubeletSimulator

__all__ = ["CHECKPOINT", "Allocation", "AllocationFailed", "Endpoint", "KubeletSimulator"]
