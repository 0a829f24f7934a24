"""The outcome of one node check, the one shape every check module returns (standard library only).

:mod:`.nicchecks`, :mod:`.ipv6checks` and :mod:`.healthchecks` return :class:`Check`; the
``rdma_node_info`` module turns them into report rows and the plugin's start checks into log
lines. A check names what it looked at (RDMA device, netdev, GPU), says what it saw and, when it
failed, the fix. A check whose source is missing is *not checked*: it says why, never passes
silently and does not fail the node (unless the caller asks for that, see ``skipped``). A *warning*
passes (fails no node) but is reported with its fix: the node works, yet something is off.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Check:
    """The outcome of one check: what was found (``detail``) and, when failed, the fix."""

    name: str  # a stable check name (each check module lists its own)
    nic: str  # RDMA device name, "" for node-wide checks
    netdev: str  # netdev checked, "" when none applies
    passed: bool
    detail: str  # the problem when failed, what was seen when passed, why when skipped
    fix: str = ""  # "" when passed or skipped
    label: str | None = None  # message prefix; None = "<nic> (<netdev>)" or "GPU <gpu>", "" = none
    gpu: str = ""  # PCI address of the GPU checked, "" when none
    skipped: bool = False  # not checked: the source is missing (``detail`` says why); ``passed`` is True
    warning: bool = False  # passed, but reported with ``fix`` (the node works; something is off)

    @property
    def problem(self) -> str:
        return "" if self.passed else self.detail

    @property
    def status(self) -> str:
        """``passed``, ``warning``, ``failed`` or ``not checked``."""
        if self.skipped:
            return "not checked"
        return ("warning" if self.warning else "passed") if self.passed else "failed"

    def message(self) -> str:
        """``<nic> (<netdev>): <detail>``, ``not checked: <why>`` when skipped, plus ``. Fix: <fix>`` when
        failed or a warning."""
        label = self.label
        if label is None:
            if self.gpu:
                label = f"GPU {self.gpu}"
            else:
                label = f"{self.nic} ({self.netdev})" if self.nic and self.netdev else self.nic or self.netdev
        detail = f"not checked: {self.detail}" if self.skipped else self.detail
        text = f"{label}: {detail}" if label else detail
        return f"{text}. Fix: {self.fix}" if not self.passed or self.warning else text

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON output and Ansible facts (``nic``, ``netdev`` and ``gpu`` null when none)."""
        return {
            "name": self.name,
            "nic": self.nic or None,
            "netdev": self.netdev or None,
            "gpu": self.gpu or None,
            "passed": self.passed,
            "skipped": self.skipped,
            "warning": self.warning,
            "problem": self.problem,
            "fix": self.fix,
            "message": self.message(),
        }


def skipped(name: str, why: str, nic: str = "", netdev: str = "", gpu: str = "", label: str | None = None) -> Check:
    """A check that could not be made: ``passed`` so that it fails no node, ``skipped`` so that no
    report counts it as a pass, ``why`` saying which source is missing."""
    return Check(name, nic, netdev, True, why, "", label=label, gpu=gpu, skipped=True)


def strict(check: Check, fix: str) -> Check:
    """``check`` with a skip turned into a failure (the caller demands every check be made)."""
    if not check.skipped:
        return check
    return Check(
        check.name,
        check.nic,
        check.netdev,
        False,
        f"could not be checked: {check.detail}",
        fix,
        label=check.label,
        gpu=check.gpu,
    )


def warning(name: str, nic: str, detail: str, fix: str, label: str | None = None) -> Check:
    """A finding that fails no node but is reported with its fix."""
    return Check(name, nic, "", True, detail, fix, label=label, warning=True)


def same_across_nics(
    name: str,
    values: Mapping[str, T],
    differs: Callable[[Mapping[str, T], T], str],
    same: Callable[[T], str],
    fix: str,
) -> Check:
    """A node-wide check that every NIC shows the same value (``values``: NIC -> value, in sysfs
    order). The most common value wins (on a tie the first seen); the NICs that differ are named
    in ``nic`` and in the message ``differs(odd, common)``, else the check passes with ``same(common)``."""
    common = Counter(values.values()).most_common(1)[0][0]
    odd = {nic: v for nic, v in values.items() if v != common}
    if odd:
        return Check(name, ",".join(odd), "", False, differs(odd, common), fix, label="")
    return Check(name, "", "", True, same(common), label="")
