"""The lossless-RoCE settings of a netdev: trust mode, PFC priorities, RoCE ECN (standard library only).

Sources, in order; a setting no source shows stays None with the reason, never a guess:

- trust: ``/sys/class/net/<if>/qos/trust`` (``dscp``/``pcp``, MLNX_OFED's mlx5 sysfs, the file
  ``mlnx_qos`` reads first), else the DCB APP table (:mod:`.dcb`);
- PFC: DCB netlink only (``struct ieee_pfc`` ``pfc_en``; no sysfs file carries it);
- ECN: ``/sys/class/net/<if>/ecn/roce_np/enable/<prio>`` and ``.../roce_rp/enable/<prio>``
  (``0``/``1``; MLNX_OFED ``en_sysfs.c``). Upstream mlx5 keeps congestion control in debugfs
  (root only), so there ECN is not checked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import text
from .sysfs import read_text

if TYPE_CHECKING:  # DCB netlink only with a client (real nodes): imported there
    from . import dcb


@dataclass(frozen=True)
class Lossless:
    netdev: str
    trust: str | None
    trust_source: str  # where trust was read, or why it could not be
    pfc: tuple[int, ...] | None  # priorities with PFC on
    pfc_source: str
    priority: int  # the lossless priority ECN was read for
    ecn_np: bool | None  # RoCE ECN on at the notification point (receiver) for ``priority``
    ecn_rp: bool | None  # ... and at the reaction point (sender)
    ecn_source: str

    def to_dict(self) -> dict[str, object]:
        return {
            "netdev": self.netdev,
            "trust": self.trust,
            "trust_source": self.trust_source,
            "pfc": None if self.pfc is None else list(self.pfc),
            "pfc_source": self.pfc_source,
            "ecn_priority": self.priority,
            "ecn_np": self.ecn_np,
            "ecn_rp": self.ecn_rp,
            "ecn_source": self.ecn_source,
        }


def _ecn(base: str, point: str, priority: int) -> bool | None:
    value = read_text(os.path.join(base, "ecn", point, "enable", str(priority)))
    return None if value not in ("0", "1") else value == "1"


def read(sysfs_root: str, netdev: str, priority: int, client: dcb.Client | None, no_client: str) -> Lossless:
    """Trust, PFC, and RoCE ECN for ``priority``. ``client`` None: DCB netlink is not used, ``no_client`` says why."""
    base = os.path.join(sysfs_root, "class", "net", text.to_fs(netdev))
    ieee: dcb.DcbIeee | None = None
    why = no_client
    if client is not None:
        from . import dcb

        try:
            ieee = client.ieee(netdev)
        except (dcb.DcbError, OSError) as exc:
            why = f"DCB netlink: {dcb.explain(exc)}"
    trust_file = os.path.join(base, "qos", "trust")
    trust = read_text(trust_file)
    if trust is not None:
        trust_source = "sysfs qos/trust"
    elif ieee is not None:
        trust, trust_source = ieee.trust, "DCB APP table"
    else:
        trust_source = f"no qos/trust in sysfs and {why}"
    if ieee is not None and ieee.pfc_cap is not None:
        pfc, pfc_source = ieee.pfc_enabled, "DCB netlink"
    else:
        pfc, pfc_source = None, "the driver reports no PFC object over DCB netlink" if ieee is not None else why
    ecn_np, ecn_rp = _ecn(base, "roce_np", priority), _ecn(base, "roce_rp", priority)
    if ecn_np is None or ecn_rp is None:
        ecn_np = ecn_rp = None
        ecn_source = (
            f"no ecn/roce_np and ecn/roce_rp enable/{priority} files in sysfs (upstream mlx5 keeps congestion "
            "control in debugfs, root only)"
        )
    else:
        ecn_source = "sysfs ecn"
    return Lossless(netdev, trust, trust_source, pfc, pfc_source, priority, ecn_np, ecn_rp, ecn_source)
