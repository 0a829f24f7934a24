"""Can this node do GPUDirect RDMA, and how (standard library only, world-readable sources).

Two ways for a NIC to reach GPU memory, as Azure's node health checks detect them
(azurehpc-health-checks ``customTests/azure_gdr_detect.nhc``):

- peer memory: ``nvidia_peermem`` (or the older ``nv_peer_mem``) loaded into MLNX_OFED/DOCA's
  ``ib_core`` (``/sys/module/<name>``; ``/sys/kernel/mm/memory_peers`` exists once a peer-memory
  client registered);
- DMA-BUF: upstream ``mlx5_ib`` imports dma-bufs since Linux 5.12 (``ib_umem_dmabuf_get``), and the
  NVIDIA *open* kernel modules export GPU memory as dma-buf from R515 on
  (``/proc/driver/nvidia/version`` names "Open Kernel Module"; ``/sys/module/nvidia/version``).
  rdma-core >= 36, CUDA >= 11.7 and NCCL >= 2.19 complete that path in the container.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from .sysfs import read_text

PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMABUF_KERNEL = (5, 12)
DMABUF_DRIVER = 515


def _version(value: str | None) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", value or "")[:3])


@dataclass(frozen=True)
class GpuDirect:
    peermem: str  # the loaded peer-memory module, "" when none
    memory_peers: bool  # /sys/kernel/mm/memory_peers exists
    kernel: str  # /proc/sys/kernel/osrelease
    nvidia_driver: str  # /sys/module/nvidia/version, "" when not loaded
    nvidia_open: bool | None  # open kernel modules; None when unknown (no /proc/driver/nvidia/version)

    @property
    def dma_buf(self) -> bool:
        driver = _version(self.nvidia_driver)
        return (
            _version(self.kernel)[:2] >= DMABUF_KERNEL
            and bool(driver)
            and driver[0] >= DMABUF_DRIVER
            and self.nvidia_open is True
        )

    @property
    def mode(self) -> str:
        """``peermem``, ``dma-buf`` or "" (no GPUDirect RDMA path), peer memory preferred as Azure does."""
        return "peermem" if self.peermem else "dma-buf" if self.dma_buf else ""

    def why_not(self) -> str:
        """Why neither path is there (for a failed check)."""
        parts = ["no nvidia_peermem (or nv_peer_mem) module is loaded"]
        if not self.nvidia_driver:
            parts.append("the NVIDIA driver is not loaded (no /sys/module/nvidia)")
        else:
            if _version(self.nvidia_driver)[:1] < (DMABUF_DRIVER,):
                parts.append(f"NVIDIA driver {self.nvidia_driver} is older than R{DMABUF_DRIVER}")
            if self.nvidia_open is not True:
                parts.append(
                    "the NVIDIA kernel modules are not the open ones"
                    if self.nvidia_open is False
                    else "it is unknown whether the NVIDIA modules are the open ones"
                )
        if _version(self.kernel)[:2] < DMABUF_KERNEL:
            parts.append(f"kernel {self.kernel or 'unknown'} is older than 5.12")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {
            "mode": self.mode or None,
            "peermem": self.peermem or None,
            "memory_peers": self.memory_peers,
            "dma_buf": self.dma_buf,
            "kernel": self.kernel or None,
            "nvidia_driver": self.nvidia_driver or None,
            "nvidia_open": self.nvidia_open,
        }


def read(sysfs_root: str, procfs_root: str) -> GpuDirect:
    peermem = next((m for m in PEERMEM_MODULES if os.path.isdir(os.path.join(sysfs_root, "module", m))), "")
    banner = read_text(os.path.join(procfs_root, "driver", "nvidia", "version"))
    return GpuDirect(
        peermem=peermem,
        memory_peers=os.path.isdir(os.path.join(sysfs_root, "kernel", "mm", "memory_peers")),
        kernel=read_text(os.path.join(procfs_root, "sys", "kernel", "osrelease")) or "",
        nvidia_driver=read_text(os.path.join(sysfs_root, "module", "nvidia", "version")) or "",
        nvidia_open=None if banner is None else "Open Kernel Module" in banner,
    )
