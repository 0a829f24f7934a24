"""The node-health checks a GPU node must pass before it runs NCCL (standard library only).

:func:`read` reads everything in one pass through the node readers (:mod:`.pcie`,
:mod:`.netdev`, :mod:`.lossless`/:mod:`.dcb`, :mod:`.portcounters`, :mod:`.gpudirect`,
:mod:`.memlock`, :mod:`.perftest`); :func:`check` is pure logic over that read and returns a
:class:`.checks.Check` per finding: the NIC, netdev or GPU, the value seen, the expected and the
fix. A check whose source the node does not have is *not checked* with the reason (never a pass);
``Expectations.fail_not_checked`` turns those into failures. ``Expectations.skip`` leaves checks
out by name. The ``rdma_node_info`` module runs them beside :mod:`.nicchecks` and :mod:`.ipv6checks`.

=====================  ======  ==================================================================
name                   scope   passes when (source of the threshold)
=====================  ======  ==================================================================
``pcie_link``          NIC     each PCI device of the NIC, and each link above it up to the root
                               port (switch uplinks), trained to its expected speed and width: the
                               lower of its own and its port's maxima (OCI GPU health checks:
                               "PCIe width missing lanes", any lane missing fails)
``gpu_pcie_link``      GPU     each NVIDIA GPU (and the links above it no NIC shares) trained to
                               its expected width; speed is reported, not failed: an idle GPU
                               lowers it, so speed is only meaningful under load (OCI
                               ``check_gpu_pcie``: x16)
``mtu``                NIC     the RoCE netdevs have ``mtu`` (when given) and the RoCE active MTU,
                               derived as the kernel does (``iboe_get_mtu``: netdev MTU minus 96
                               bytes of headers) or read by libibverbs, is ``roce_mtu`` (4096: a
                               netdev MTU of at least 4192, e.g. 4200 or 9000)
``mtu_consistent``     node    every RoCE NIC has the same netdev and active MTU
``netdev_link``        NIC     every netdev of a RoCE NIC (bond and members) is up with carrier
``bond``               NIC     the NIC's bond has ``bond_mode`` (when given), every PCI netdev of
                               the NIC is a slave and every slave's MII status is up
``lacp``               NIC     802.3ad: every slave is in the same aggregator, its partner churn
                               state is ``none`` and the partner is in sync, collecting and
                               distributing (bond_procfs.c, bonding_slave/ad_partner_oper_port_state)
``roce_trust``         netdev  trust mode is ``roce_trust`` (dscp; NVIDIA nic-configuration-operator
                               ``roceOptimized``: trust dscp)
``roce_pfc``           netdev  PFC is on for ``pfc_priority`` (3; nic-configuration-operator: PFC
                               on priority 3, Spectrum-X RA ``00010000``), read over DCB netlink
``roce_ecn``           netdev  RoCE ECN is on for ``pfc_priority`` at the notification and reaction
                               points (nic-configuration-operator: ``ROCE_CC_PRIO_MASK=255``)
``port_counters``      NIC     judged by growth, never by lifetime totals (the counters live in
                               the HCA and saturate, :mod:`.portcounters`): no ``counter_watch``
                               counter grows within ``counter_interval`` seconds of this read (a
                               link taking errors now), and no ``counter_max`` counter grew more
                               than its limit since the values the previous run stored for the
                               node (``baseline``; default any growth of the 4-bit
                               ``excessive_buffer_overrun_errors`` / ``local_link_integrity_errors``,
                               the counters NVIDIA's NVSentinel NIC monitor treats as fatal). A
                               counter at its maximum is reported not checked (reset it)
``link_flap``          NIC     ``link_downed`` and the netdevs' ``carrier_changes`` do not grow
                               within ``counter_interval`` seconds (Azure ``check_ib_link_flapping``
                               and OCI ``RdmaLinkFlapping`` fail on link-down events; they read the
                               kernel log, this read watches the counters)
``gid_index``          NIC     with ``NCCL_IB_GID_INDEX`` pinned (``nccl_gid_index``), the GID at
                               that index is a RoCE v2 GID of the NCCL address family on every RoCE
                               NIC; else the GID NCCL picks per NIC (``ncclIbGetGidIndex``, :mod:`.gids`)
                               is one, on the compute network when ``compute_networks`` is given.
                               Different indexes across NICs are fine then: NCCL picks per device
``gpu_nic_numa``       GPU     the GPU has an RDMA NIC on its NUMA node (Azure
                               ``check_hw_topology``: devices on their expected NUMA nodes)
``topology``           NIC     the GPUs that share the NIC's PCIe switch are ``topology_expected``
                               (when given)
``gpudirect``          node    ``nvidia_peermem`` is loaded or DMA-BUF is possible (kernel 5.12+,
                               NVIDIA open modules R515+) (Azure ``azure_gdr_detect.nhc``); only
                               with ``gpudirect_required``
``memlock``            node    the container runtime (running process and its unit) has an
                               unlimited RLIMIT_MEMLOCK (AWS GPU health checks warn below 16 GiB).
                               A warning when RDMA pods run with CAP_IPC_LOCK (``ipc_lock``, the
                               chart's admission policy requires it): ``ib_umem_get`` enforces the
                               limit only for callers without it; a failure when they would not
``perftest``           NIC     ``ib_write_bw`` loopback reaches ``perftest_min_percent`` of the
                               port rate (Azure ``check_ib_bw_*``: 375 of 400 Gb/s NDR, 185 of
                               200 Gb/s HDR, i.e. 92.5-93.75 %); only with ``perftest``
=====================  ======  ==================================================================
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import gids, gpudirect, lossless, memlock, netdev, pcie, portcounters, sysfs, text, topology
from .checks import Check, same_across_nics, skipped, strict, warning

if TYPE_CHECKING:  # imported where used: DCB netlink on real nodes only, perftest only when asked
    from . import dcb, perftest

PCIE_LINK = "pcie_link"
GPU_PCIE_LINK = "gpu_pcie_link"
MTU = "mtu"
MTU_CONSISTENT = "mtu_consistent"
NETDEV_LINK = "netdev_link"
BOND = "bond"
LACP = "lacp"
ROCE_TRUST = "roce_trust"
ROCE_PFC = "roce_pfc"
ROCE_ECN = "roce_ecn"
PORT_COUNTERS = "port_counters"
LINK_FLAP = "link_flap"
GID_INDEX = "gid_index"
GPU_NIC_NUMA = "gpu_nic_numa"
TOPOLOGY = "topology"
GPUDIRECT = "gpudirect"
MEMLOCK = "memlock"
PERFTEST = "perftest"
CHECK_NAMES = (
    PCIE_LINK,
    GPU_PCIE_LINK,
    MTU,
    MTU_CONSISTENT,
    NETDEV_LINK,
    BOND,
    LACP,
    ROCE_TRUST,
    ROCE_PFC,
    ROCE_ECN,
    PORT_COUNTERS,
    LINK_FLAP,
    GID_INDEX,
    GPU_NIC_NUMA,
    TOPOLOGY,
    GPUDIRECT,
    MEMLOCK,
    PERFTEST,
)

ROCE_MTUS = (256, 512, 1024, 2048, 4096)
# IB_GRH_BYTES + IB_UDP_BYTES + IB_BTH_BYTES + IB_EXT_XRC_BYTES + IB_EXT_ATOMICETH_BYTES + IB_ICRC_BYTES
ROCE_HEADERS = 40 + 8 + 12 + 4 + 28 + 4
DEFAULT_COUNTER_MAX: Mapping[str, int] = {"excessive_buffer_overrun_errors": 0, "local_link_integrity_errors": 0}
# Counters whose growth within one read fails the NIC: a link taking errors now (link_downed is link_flap's).
DEFAULT_COUNTER_WATCH = (
    "symbol_error",
    "link_error_recovery",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
DEFAULT_COUNTER_INTERVAL = 3.0
AUTO = "auto"
TRUST_MODES = ("dscp", "pcp")
BOND_MODES = netdev.MODES
MAX_INTERVAL = 60.0
MAX_PERFTEST_SECONDS = 60


def roce_active_mtu(netdev_mtu: int) -> int:
    """The RoCE MTU the kernel derives from a netdev MTU (``iboe_get_mtu`` in include/rdma/ib_addr.h)."""
    room = netdev_mtu - ROCE_HEADERS
    return max((m for m in ROCE_MTUS if m <= room), default=0)


@dataclass(frozen=True)
class Expectations:
    """What the node must show (the module's options); None = not checked."""

    mtu: int | None = None
    roce_mtu: int = 4096
    bond_mode: str | None = None
    roce_trust: str = "dscp"
    pfc_priority: int = 3
    counter_max: Mapping[str, int] = field(
        default_factory=lambda: dict(DEFAULT_COUNTER_MAX)
    )  # growth since the baseline
    counter_watch: tuple[str, ...] = DEFAULT_COUNTER_WATCH  # no growth within counter_interval
    counter_interval: float = DEFAULT_COUNTER_INTERVAL
    nccl_addr_family: str = AUTO  # AUTO: as the plugin's workloadEnv (AF_INET where every NIC has it)
    nccl_gid_index: int | None = None  # NCCL_IB_GID_INDEX when the deployment pins it
    compute_networks: tuple[str, ...] = ()  # the GID NCCL uses must be on one (when given)
    ipc_lock: bool = True  # RDMA pods run with CAP_IPC_LOCK (the chart's admission policy requires it)
    topology_expected: Mapping[str, Sequence[str]] | None = None
    gpudirect_required: bool = False
    perftest: bool = False
    perftest_min_percent: float = 92.5
    perftest_seconds: int = 5
    perftest_command: str = "ib_write_bw"
    skip: frozenset[str] = frozenset()
    fail_not_checked: bool = False

    def __post_init__(self) -> None:
        def bad(option: str, value: object, want: str) -> ValueError:
            return ValueError(f"{option} must be {want}, not {value!r}")

        if self.mtu is not None and not 68 <= self.mtu <= 65535:
            raise bad("mtu", self.mtu, "a netdev MTU between 68 and 65535 or null")
        if self.roce_mtu not in ROCE_MTUS:
            raise bad("roce_mtu", self.roce_mtu, f"one of {list(ROCE_MTUS)}")
        if self.bond_mode is not None and self.bond_mode not in netdev.MODES:
            raise bad("bond_mode", self.bond_mode, f"one of {list(netdev.MODES)} or null")
        if self.roce_trust not in TRUST_MODES:
            raise bad("roce_trust", self.roce_trust, f"one of {list(TRUST_MODES)}")
        if not 0 <= self.pfc_priority <= 7:
            raise bad("pfc_priority", self.pfc_priority, "a priority from 0 to 7")
        for name, limit in self.counter_max.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise bad(f"counter_max.{name}", limit, "a count of 0 or more")
        if not 0 <= self.counter_interval <= MAX_INTERVAL:
            raise bad("counter_interval", self.counter_interval, f"seconds from 0 (off) to {MAX_INTERVAL:g}")
        if self.nccl_addr_family not in (*gids.ADDR_FAMILIES, AUTO):
            raise bad("nccl_addr_family", self.nccl_addr_family, f"one of {[*gids.ADDR_FAMILIES, AUTO]}")
        if self.nccl_gid_index is not None and not 0 <= self.nccl_gid_index < 256:
            raise bad("nccl_gid_index", self.nccl_gid_index, "a GID index from 0 to 255 or null (not pinned)")
        if not 0 < self.perftest_min_percent <= 100:
            raise bad("perftest_min_percent", self.perftest_min_percent, "a percentage above 0 and at most 100")
        if not 1 <= self.perftest_seconds <= MAX_PERFTEST_SECONDS:
            raise bad("perftest_seconds", self.perftest_seconds, f"from 1 to {MAX_PERFTEST_SECONDS}")
        unknown = sorted(set(self.skip) - set(CHECK_NAMES))
        if unknown:
            raise bad("skip_checks", unknown, f"check names out of {list(CHECK_NAMES)}")


# --------------------------------------------------------------------------- the read


@dataclass
class NicRead:
    """What the node shows about one RDMA NIC."""

    nic: sysfs.Nic
    functions: list[pcie.Function]  # one PCI function per physical device behind the NIC
    netdevs: dict[str, netdev.Netdev]
    bond: netdev.Bond | None
    qos: dict[str, lossless.Lossless]  # per PCI netdev (Ethernet NICs)
    counters: dict[int, dict[str, int]]  # port -> counters at the first read
    counters_after: dict[int, dict[str, int]] = field(default_factory=dict)  # port -> the same, later
    carrier_after: dict[str, int | None] = field(default_factory=dict)
    carrier_before: dict[str, int | None] = field(default_factory=dict)  # netdev -> a kept sample's (else read now)
    gid_index: dict[int, int] = field(default_factory=dict)  # port -> NCCL's GID index
    active_mtu: dict[int, int] = field(default_factory=dict)  # port -> libibverbs' active MTU, when read
    perftest: dict[int, perftest.Result] = field(default_factory=dict)
    links: list[pcie.Function] = field(default_factory=list)  # the bridges whose links lead up to the root port

    @property
    def ethernet(self) -> bool:
        return "Ethernet" in self.nic.link_layers

    @property
    def placement(self) -> topology.Placement | None:
        return topology.placement(self.functions[0]) if self.functions else None

    @property
    def pci_netdevs(self) -> list[str]:
        return [n for n, d in self.netdevs.items() if d.pci]

    @property
    def latest_counters(self) -> dict[int, dict[str, int]]:
        """Each counter's last value read."""
        return {p: {**v, **self.counters_after.get(p, {})} for p, v in self.counters.items()}


@dataclass
class NodeRead:
    nics: list[NicRead]
    gpus: list[pcie.Function]
    gpudirect: gpudirect.GpuDirect
    runtimes: list[memlock.Runtime]
    interval: float  # seconds between the two counter reads, 0 when there was one read
    dcb: str  # "" when DCB netlink was used, else why not
    perftest: str  # "" when perftest ran, else why not
    family: str = gids.AF_INET  # the NCCL address family the GID picks are for
    baseline: Mapping[str, Any] = field(default_factory=dict)  # the previous run's stored counters
    taken: float = 0.0  # time.time() of the first counter read
    gpu_links: list[pcie.Function] = field(default_factory=list)  # bridges above GPUs that no NIC path has


@dataclass
class CounterWatch:
    """The first read of the counters a read compares: taken as early as possible, so that the
    ``counter_interval`` runs while the rest of the node is read (:func:`watch_counters`)."""

    start: float  # clock() at the read
    taken: float  # time.time() at the read
    counters: dict[str, dict[int, dict[str, int]]]  # NIC -> port -> counter -> value
    carriers: dict[str, dict[str, int | None]] = field(default_factory=dict)  # NIC -> netdev -> carrier_changes
    kept: bool = False  # a sample the node kept from an earlier read (:func:`watch_from_samples`)


def watched_counters(want: Expectations) -> list[str]:
    return sorted(set(want.counter_max) | set(want.counter_watch) | set(portcounters.FLAP_COUNTERS))


def watch_counters(
    nics: Sequence[sysfs.Nic], sysfs_root: str, want: Expectations, clock: Callable[[], float] = time.monotonic
) -> CounterWatch:
    """Read the compared counters of ``nics`` now (the first of the two reads)."""
    names = watched_counters(want)
    found = {
        nic.name: {p.number: portcounters.read_port(sysfs_root, nic.name, p.number, names) for p in nic.ports}
        for nic in nics
    }
    return CounterWatch(clock(), time.time(), found)


# The counters a node keeps of its reads (a small file on the node, rdma_node_info's counter window): the
# next read within the window compares with them instead of waiting counter_interval seconds, so that a
# validation run holds no worker while the counters move. Two samples are kept: the first read of the
# last run and its last read; a read takes the newest one at least counter_interval old (no wait), else
# the oldest one (it waits only what is left of the interval), else reads twice as before.
SAMPLE_VERSION = 1


def watch_from_samples(
    kept: Mapping[str, Any] | None,
    nics: Sequence[sysfs.Nic],
    want: Expectations,
    window: float,
    clock: Callable[[], float] = time.monotonic,
    now: float | None = None,
) -> CounterWatch | None:
    """The first counter read from the node's kept samples (:func:`kept_samples`): one at most ``window``
    seconds old that covers every NIC (same node GUID, every port) and every compared counter; None when
    there is none (the caller reads now and waits the interval)."""
    if (
        not kept
        or kept.get("version") != SAMPLE_VERSION
        or not set(watched_counters(want)) <= set(kept.get("names") or ())
    ):
        return None
    now = time.time() if now is None else now
    usable = []
    for sample in kept.get("samples") or []:
        try:
            age = now - float(sample["taken"])
            per = sample["nics"]
            if not 0 <= age <= window or not all(
                per[n.name]["node_guid"] == n.node_guid
                and {str(p.number) for p in n.ports} <= set(per[n.name]["ports"])
                for n in nics
            ):
                continue
        except (KeyError, TypeError, ValueError):
            continue
        usable.append((age, sample))
    if not usable:
        return None
    old = [u for u in usable if u[0] >= want.counter_interval]
    age, sample = min(old, key=lambda u: u[0]) if old else max(usable, key=lambda u: u[0])
    try:
        counters = {
            n.name: {
                int(p): {str(k): int(v) for k, v in values.items()}
                for p, values in sample["nics"][n.name]["ports"].items()
            }
            for n in nics
        }
        carriers = {n.name: dict(sample["nics"][n.name].get("carriers") or {}) for n in nics}
    except (AttributeError, TypeError, ValueError):
        return None
    return CounterWatch(clock() - age, float(sample["taken"]), counters, carriers, kept=True)


def _sample(node: NodeRead, taken: float, last: bool) -> dict[str, Any]:
    nics = {}
    for r in node.nics:
        if last:
            carriers = {n: r.carrier_after.get(n, d.carrier_changes) for n, d in r.netdevs.items()}
            ports = r.latest_counters
        else:
            carriers = {n: r.carrier_before.get(n, d.carrier_changes) for n, d in r.netdevs.items()}
            ports = r.counters
        nics[r.nic.name] = {
            "node_guid": r.nic.node_guid,
            "ports": {str(p): v for p, v in ports.items()},
            "carriers": carriers,
        }
    return {"taken": round(taken, 3), "nics": nics}


def kept_samples(node: NodeRead, want: Expectations) -> dict[str, Any]:
    """What the node keeps of this read for the next one: its first counter read (a kept sample or this
    read's own) and its last, with when each was taken."""
    samples = [_sample(node, node.taken, last=False)]
    if node.interval > 0:
        samples.append(_sample(node, node.taken + node.interval, last=True))
    return {"version": SAMPLE_VERSION, "names": watched_counters(want), "samples": samples}


def _functions(sysfs_root: str, nic: sysfs.Nic, netdevs: Mapping[str, netdev.Netdev]) -> list[pcie.Function]:
    """The NIC's own function and those behind its PCI netdevs, one per physical device (the
    functions of one device share its link)."""
    addresses = [nic.pci_address]
    for name, dev in netdevs.items():
        if dev.pci:
            real = os.path.realpath(os.path.join(sysfs_root, "class", "net", text.to_fs(name), "device"))
            addresses.append(text.from_fs(os.path.basename(real)))
    seen: dict[str, pcie.Function] = {}
    for address in addresses:
        device = address.rsplit(".", 1)[0]
        if device in seen:
            continue
        found = pcie.read_function(sysfs_root, address)
        if found is not None:
            seen[device] = found
    return list(seen.values())


def _upstream(sysfs_root: str, functions: Sequence[pcie.Function], seen: set[str]) -> list[pcie.Function]:
    """The bridges above ``functions`` whose links are not read yet (``seen`` grows)."""
    out = []
    for fn in functions:
        for bridge in pcie.uplinks(sysfs_root, fn):
            if bridge.address not in seen:
                seen.add(bridge.address)
                out.append(bridge)
    return out


def read(
    nics: Sequence[sysfs.Nic],
    sysfs_root: str,
    procfs_root: str,
    host_root: str,
    want: Expectations,
    real_node: bool,
    active_mtu: Mapping[str, Sequence[int]] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    watch: CounterWatch | None = None,
    baseline: Mapping[str, Any] | None = None,
) -> NodeRead:
    """One pass over the node. ``real_node``: the roots are this host's own (DCB netlink and
    perftest talk to the kernel and devices, so they run only then). ``active_mtu``: per NIC, the
    ports' active MTU from libibverbs. ``watch``: the first counter read, taken by the caller as
    early as it could (else here); the counters are read again ``want.counter_interval`` seconds
    after it, once everything else (perftest included) is read. ``baseline``: the counters the
    previous run stored for this node (:func:`next_baseline`)."""
    if watch is None:
        watch = watch_counters(nics, sysfs_root, want, clock)
    reads: list[NicRead] = []
    for nic in nics:
        devs = {name: netdev.read_netdev(sysfs_root, name) for name in nic.netdevs}
        reads.append(
            NicRead(
                nic,
                [],
                devs,
                None,
                {},
                watch.counters.get(nic.name, {}),
                carrier_before=watch.carriers.get(nic.name, {}),
            )
        )
    family = want.nccl_addr_family
    if family == AUTO:
        family = gids.auto_family([p for r in reads for p in r.nic.ports])
    client: dcb.Client | None = None
    why_no_dcb = "DCB netlink reads the node's own netdevs, and these sysfs/procfs roots are a fixture"
    if real_node:
        from . import dcb  # netlink: real nodes only

        try:
            client = dcb.Client()
            why_no_dcb = ""
        except OSError as exc:
            why_no_dcb = f"no netlink socket ({exc})"
    bridges: set[str] = set()
    try:
        for r in reads:
            r.functions = _functions(sysfs_root, r.nic, r.netdevs)
            r.links = _upstream(sysfs_root, r.functions, bridges)
            masters = {d.master for d in r.netdevs.values() if d.master}
            bonds = [b for b in (netdev.read_bond(sysfs_root, procfs_root, m) for m in sorted(masters)) if b]
            r.bond = bonds[0] if bonds else None
            if r.ethernet:
                r.qos = {n: lossless.read(sysfs_root, n, want.pfc_priority, client, why_no_dcb) for n in r.pci_netdevs}
            r.gid_index = {p.number: gids.nccl_gid_index(p, family) for p in r.nic.ports}
            if active_mtu and r.nic.name in active_mtu:
                r.active_mtu = dict(enumerate(active_mtu[r.nic.name], start=1))
    finally:
        if client is not None:
            client.close()
    gpus = pcie.read_gpus(sysfs_root)
    node = NodeRead(
        nics=reads,
        gpus=gpus,
        gpudirect=gpudirect.read(sysfs_root, procfs_root),
        runtimes=memlock.read(procfs_root, host_root),
        interval=0.0,
        dcb=why_no_dcb,
        perftest="",
        family=family,
        baseline=baseline or {},
        taken=watch.taken,
        gpu_links=_upstream(sysfs_root, gpus, bridges),
    )
    node.perftest = _perftest(node, want, real_node) if want.perftest and PERFTEST not in want.skip else ""
    if want.counter_interval > 0:  # the second read, once the rest (perftest's load included) is done
        left = want.counter_interval - (clock() - watch.start)
        if left > 0:
            sleep(left)
        names = watched_counters(want)
        for r in reads:
            r.counters_after = {
                p.number: portcounters.read_port(sysfs_root, r.nic.name, p.number, names) for p in r.nic.ports
            }
            r.carrier_after = {n: netdev.read_carrier_changes(sysfs_root, n) for n in r.netdevs}
        node.interval = clock() - watch.start
    return node


def _perftest(node: NodeRead, want: Expectations, real_node: bool) -> str:
    """Run the loopback test on every active port; why it did not run ("" when it did)."""
    import shutil  # only with perftest

    from . import perftest

    if not real_node:
        return "perftest runs on the node's own devices, and these roots are a fixture"
    command = shutil.which(want.perftest_command)
    if command is None:
        return f"{want.perftest_command} (perftest) is not installed (apt/dnf install perftest)"
    for r in node.nics:
        for port in r.nic.ports:
            if port.active:
                gid = r.gid_index.get(port.number) if port.link_layer == "Ethernet" else None
                r.perftest[port.number] = perftest.run_loopback(
                    command, r.nic.name, port.number, gid, want.perftest_seconds
                )
    return ""


# --------------------------------------------------------------------------- the checks


def _gts(value: float | None) -> str:
    return "Unknown" if value is None else f"{value:g} GT/s"


def _pcie(name: str, nic: str, gpu: str, fn: pcie.Function, width_only: bool, below: str = "") -> Check:
    """``fn``'s link; ``below``: the device ``fn`` (a switch upstream port) leads to, for a link up the path."""
    link = fn.link
    label = f"{nic} PCIe {fn.address}" if nic else None
    if below:
        label = f"{nic or f'GPU {gpu}'} PCIe {fn.address} (switch uplink above {below})"
    if link is None:
        return skipped(
            name, f"{fn.address} has no PCIe link attributes (not a PCIe function)", nic=nic, gpu=gpu, label=label
        )
    want_speed, want_width = link.expected_speed, link.expected_width
    if want_width is None or (want_speed is None and not width_only):
        return skipped(
            name, f"{fn.address} does not show its maximum link speed and width", nic=nic, gpu=gpu, label=label
        )
    seen = f"{_gts(link.speed)} x{link.width if link.width is not None else '?'}"
    slow = not width_only and (link.speed is None or want_speed is None or link.speed < want_speed)
    narrow = link.width is None or link.width < want_width
    expected = f"x{want_width}" if width_only else f"{_gts(want_speed)} x{want_width}"
    fix = (
        f"reseat the card and its riser, check the slot's PCIe settings in the BIOS, compare LnkSta with LnkCap "
        f"(lspci -vv -s {fn.address}); replace the card, riser or cable if it trains down again"
    )
    if slow or narrow:
        return Check(name, nic, "", False, f"link runs at {seen}, expected {expected}", fix, label=label, gpu=gpu)
    note = " (an idle GPU lowers its speed: it is checked only under load, not here)" if width_only else ""
    return Check(name, nic, "", True, f"link at {seen}{note}", label=label, gpu=gpu)


def _mtu(r: NicRead, want: Expectations) -> Check:
    nic = r.nic
    if not r.ethernet:
        if r.active_mtu:
            bad = {p: m for p, m in r.active_mtu.items() if m != want.roce_mtu}
            detail = ", ".join(f"port {p} active MTU {m}" for p, m in sorted(r.active_mtu.items()))
            return Check(
                MTU,
                nic.name,
                "",
                not bad,
                detail + ("" if not bad else f", expected {want.roce_mtu}"),
                ""
                if not bad
                else "set the subnet manager's MTU for the partition (opensm: mtu in "
                "partitions.conf) to 4096 and re-sweep the fabric",
            )
        return skipped(
            MTU,
            "InfiniBand: the subnet manager sets the port MTU and sysfs does not show it "
            "(libibverbs does, where pyverbs runs on the node)",
            nic=nic.name,
        )
    owner = nic.compute_netdevs[0] if nic.compute_netdevs else ""
    devs = {n: d for n, d in r.netdevs.items() if d.exists}
    if not owner or owner not in devs or devs[owner].mtu is None:
        return skipped(MTU, f"the netdev of its RoCE GIDs ({owner or 'none'}) shows no MTU", nic=nic.name)
    problems = []
    if want.mtu is not None:
        problems += [f"{n} MTU {d.mtu}" for n, d in devs.items() if d.mtu != want.mtu]
    owner_mtu = devs[owner].mtu or 0
    derived = roce_active_mtu(owner_mtu)
    active = set(r.active_mtu.values()) if r.active_mtu else {derived}
    source = "libibverbs" if r.active_mtu else f"derived from {owner} MTU {owner_mtu}"
    if any(a != want.roce_mtu for a in active):
        problems.append(f"RoCE active MTU {'/'.join(str(a) for a in sorted(active))} ({source})")
    mtus = ", ".join(f"{n} {d.mtu}" for n, d in devs.items())
    expected = f"MTU {want.mtu} and " if want.mtu is not None else ""
    if problems:
        return Check(
            MTU,
            nic.name,
            owner,
            False,
            f"{'; '.join(problems)}, expected {expected}RoCE active MTU {want.roce_mtu} "
            f"(a netdev MTU of at least {want.roce_mtu + ROCE_HEADERS})",
            f"ip link set {owner} mtu {want.mtu or 4200} (a bond passes it to its members), persist it in the node's "
            "network config, and give the switch ports an MTU at least as large",
        )
    return Check(MTU, nic.name, owner, True, f"MTU {mtus}; RoCE active MTU {want.roce_mtu} ({source})")


def _link(r: NicRead) -> Check:
    down = []
    for name, dev in r.netdevs.items():
        if not dev.exists:
            down.append(f"{name} is missing")
        elif not dev.link_up:
            carrier = {True: "carrier", False: "no carrier", None: "carrier unknown"}[dev.carrier]
            down.append(f"{name} is {dev.operstate or 'in an unknown state'} ({carrier})")
    seen = ", ".join(r.netdevs) or "none"
    if down:
        return Check(
            NETDEV_LINK,
            r.nic.name,
            "",
            False,
            "; ".join(down) + " (a bond with a member down runs at part of its bandwidth)",
            "check the cable, transceiver and switch port of each netdev named, then ip link set <netdev> up",
        )
    return Check(NETDEV_LINK, r.nic.name, "", True, f"{seen} up with carrier")


def _bond(r: NicRead, want: Expectations) -> list[Check]:
    bond = r.bond
    if bond is None:
        return []
    problems = []
    if want.bond_mode is not None and bond.mode != want.bond_mode:
        problems.append(f"mode is {bond.mode or 'unknown'}, expected {want.bond_mode}")
    members = set(bond.sysfs_slaves) | {s.name for s in bond.slaves}
    loose = [n for n in r.pci_netdevs if n not in members]
    if loose:
        problems.append(f"{', '.join(loose)} not enslaved (slaves: {', '.join(sorted(members)) or 'none'})")
    if bond.proc:
        if bond.mii_status != "up":
            problems.append(f"bond MII status {bond.mii_status or 'unknown'}")
        problems += [
            f"slave {s.name} MII status {s.mii_status or 'unknown'}" for s in bond.slaves if s.mii_status != "up"
        ]
    out = []
    fix = (
        f"ip link set <slave> master {bond.name} for a missing slave, fix the link of a slave that is down, "
        "and set the bond mode in the node's network config"
    )
    detail = f"{bond.name} mode {bond.mode or 'unknown'}, slaves {', '.join(s.name for s in bond.slaves) or 'none'}"
    if problems:
        out.append(Check(BOND, r.nic.name, bond.name, False, "; ".join(problems), fix))
    else:
        out.append(Check(BOND, r.nic.name, bond.name, True, detail + (" up" if bond.proc else "")))
    if bond.mode == "802.3ad":
        out.append(_lacp(r.nic.name, bond))
    return out


def _lacp(nic: str, bond: netdev.Bond) -> Check:
    if not bond.slaves or all(not s.partner_churn and s.partner_state is None for s in bond.slaves):
        return skipped(
            LACP,
            "neither /proc/net/bonding churn states nor bonding_slave/ad_partner_oper_port_state are readable",
            nic=nic,
            netdev=bond.name,
        )
    problems = []
    aggregators = {s.aggregator_id for s in bond.slaves}
    for s in bond.slaves:
        if s.aggregator_id in ("", "N/A"):
            problems.append(f"{s.name} is in no aggregator")
        if s.partner_churn and s.partner_churn != "none":
            problems.append(f"{s.name} partner churn state {s.partner_churn}")
        if s.partner_in_service is False:
            problems.append(
                f"{s.name} partner LACP state {s.partner_state:#04x} is not in sync/collecting/distributing"
            )
    if len(aggregators - {"", "N/A"}) > 1:
        problems.append(f"slaves are split over aggregators {', '.join(sorted(aggregators))}")
    if problems:
        return Check(
            LACP,
            nic,
            bond.name,
            False,
            "; ".join(problems),
            "configure the switch ports of the slaves as one LACP port-channel (MLAG) and check their state "
            "(a churned partner sends no LACPDUs; monitoring means still negotiating)",
        )
    return Check(LACP, nic, bond.name, True, f"LACP partner in sync on {', '.join(s.name for s in bond.slaves)}")


def _qos(r: NicRead, want: Expectations) -> list[Check]:
    out = []
    prio = want.pfc_priority
    for name, q in r.qos.items():
        nic = r.nic.name
        if q.trust is None:
            out.append(skipped(ROCE_TRUST, f"trust mode unknown: {q.trust_source}", nic=nic, netdev=name))
        else:
            ok = q.trust == want.roce_trust
            out.append(
                Check(
                    ROCE_TRUST,
                    nic,
                    name,
                    ok,
                    f"trust {q.trust} ({q.trust_source})" + ("" if ok else f", expected {want.roce_trust}"),
                    ""
                    if ok
                    else f"mlnx_qos -i {name} --trust {want.roce_trust} (or the NIC configuration "
                    "operator's roceOptimized), and persist it at boot",
                )
            )
        if q.pfc is None:
            out.append(skipped(ROCE_PFC, f"PFC unknown: {q.pfc_source}", nic=nic, netdev=name))
        else:
            vector = ",".join("1" if p in q.pfc else "0" for p in range(8))
            ok = prio in q.pfc
            out.append(
                Check(
                    ROCE_PFC,
                    nic,
                    name,
                    ok,
                    f"PFC {vector}" + ("" if ok else f", expected on for priority {prio}"),
                    ""
                    if ok
                    else f"mlnx_qos -i {name} --pfc "
                    f"{','.join('1' if p == prio else '0' for p in range(8))}, the same priority as the "
                    "switch, persisted at boot",
                )
            )
        if q.ecn_np is None or q.ecn_rp is None:
            out.append(skipped(ROCE_ECN, f"RoCE ECN unknown: {q.ecn_source}", nic=nic, netdev=name))
        else:
            missing = [p for p, on in (("notification point", q.ecn_np), ("reaction point", q.ecn_rp)) if not on]
            out.append(
                Check(
                    ROCE_ECN,
                    nic,
                    name,
                    not missing,
                    f"RoCE ECN on priority {prio} "
                    + ("enabled" if not missing else f"off at the {' and '.join(missing)}"),
                    ""
                    if not missing
                    else f"echo 1 > /sys/class/net/{name}/ecn/roce_np/enable/{prio}; echo 1 > "
                    f"/sys/class/net/{name}/ecn/roce_rp/enable/{prio} (or mlxconfig ROCE_CC_PRIO_MASK_P1=255)",
                )
            )
    return out


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _previous(r: NicRead, node: NodeRead) -> tuple[dict[int, dict[str, int]], str, str]:
    """The counters the previous run stored for this NIC (port -> counter -> value), when, and why there
    are none ("" when there are): none stored, or another NIC under the name since (node GUID)."""
    entry = (node.baseline.get("nics") or {}).get(r.nic.name)
    if not isinstance(entry, Mapping):
        return {}, "", "no values of a previous run" if not node.baseline else "the previous run stored none for it"
    if entry.get("node_guid") and entry.get("node_guid") != r.nic.node_guid:
        return {}, "", f"the NIC was replaced since the previous run (node GUID {entry.get('node_guid')})"
    ports = entry.get("ports") or {}
    found = {int(p): {str(k): int(v) for k, v in values.items()} for p, values in ports.items()}
    return found, _when(float(entry.get("taken") or 0)), ""


def baseline_growth(r: NicRead, node: NodeRead, want: Expectations) -> list[str]:
    """``counter_max`` counters that grew more than their limit since the previous run's values."""
    before, when, _ = _previous(r, node)
    out = []
    for port, values in sorted(r.latest_counters.items()):
        for name, limit in sorted(want.counter_max.items()):
            old = before.get(port, {}).get(name)
            if old is None or name not in values:
                continue
            grew = portcounters.growth(old, values[name])
            if grew > limit:
                reset = " (reset in between)" if values[name] < old else ""
                out.append(
                    f"port {port} {name} {old} -> {values[name]}{reset} since the previous run ({when}), over {limit}"
                )
    return out


def _counters(r: NicRead, node: NodeRead, want: Expectations) -> list[Check]:
    """Growth within this read (``counter_watch``) and since the previous run (``counter_max``); the
    totals are reported. A saturated counter is a not-checked row of its own: it cannot show growth."""
    nic = r.nic.name
    judged = set(want.counter_watch) | set(want.counter_max)
    latest = r.latest_counters
    seen = sorted({n for values in latest.values() for n in values if n in judged})
    if not seen:
        return [
            skipped(PORT_COUNTERS, f"the device shows none of {', '.join(sorted(judged)) or 'no counter'}", nic=nic)
        ]
    problems = []
    span = f"{node.interval:.1f} s"
    for port, after in sorted(r.counters_after.items()):
        for name in want.counter_watch:
            before = r.counters.get(port, {}).get(name)
            if before is not None and name in after and portcounters.growth(before, after[name]) > 0:
                problems.append(f"port {port} {name} {before} -> {after[name]} within {span}")
    problems += baseline_growth(r, node, want)
    totals = [
        f"port {p} {n} {v}"
        for p, values in sorted(latest.items())
        for n, v in sorted(values.items())
        if v and n in judged
    ]
    full = [f"port {p} {n} {v}" for p, values in sorted(latest.items()) for n, v in sorted(values.items())
            if n in judged and portcounters.saturated(n, v)]  # fmt: skip
    out = []
    if full:
        out.append(
            skipped(
                PORT_COUNTERS,
                f"{', '.join(full)}: at the counter's maximum (it saturates), so new errors cannot show; reset the "
                "port counters (InfiniBand: perfquery -x -R; a firmware reset clears them too) to watch it again",
                nic=nic,
            )
        )
    _, _, no_previous = _previous(r, node)
    windows = ([f"within {span}"] if r.counters_after else []) + ([] if no_previous else ["since the previous run"])
    shown = f"; lifetime totals (not judged): {', '.join(totals)}" if totals else ""
    if problems:
        out.insert(
            0,
            Check(
                PORT_COUNTERS,
                nic,
                "",
                False,
                f"error counters grew: {'; '.join(problems)}{shown}",
                "the link takes errors: check the cable, transceiver and switch port (their counters too) and, for "
                "buffer overruns, the lossless configuration; after the repair reset the port counters (InfiniBand: "
                "perfquery -x -R) - the stored values of the previous run stay until this check passes",
            ),
        )
    elif not windows:
        why = f"counter_interval is 0 and {no_previous}" if want.counter_interval <= 0 else no_previous
        out.insert(0, skipped(PORT_COUNTERS, f"no growth to judge: {why}{shown}", nic=nic))
    else:
        out.insert(0, Check(PORT_COUNTERS, nic, "", True, f"no error counter grew {' or '.join(windows)}{shown}"))
    return out


def _flap(r: NicRead, node: NodeRead, want: Expectations) -> Check:
    nic = r.nic.name
    if want.counter_interval <= 0:
        return skipped(LINK_FLAP, "counter_interval is 0 (give it a few seconds to watch link_downed)", nic=nic)
    grew = []
    for port, after in sorted(r.counters_after.items()):
        for name in portcounters.FLAP_COUNTERS:
            before = r.counters.get(port, {}).get(name)
            if before is not None and name in after and portcounters.growth(before, after[name]) > 0:
                grew.append(f"port {port} {name} {before} -> {after[name]}")
    for name, after_changes in r.carrier_after.items():
        before_changes = r.carrier_before[name] if name in r.carrier_before else r.netdevs[name].carrier_changes
        if before_changes is not None and after_changes is not None and after_changes > before_changes:
            grew.append(f"{name} carrier_changes {before_changes} -> {after_changes}")
    flaps = sum(n in v for v in r.counters_after.values() for n in portcounters.FLAP_COUNTERS)
    watched = flaps + sum(v is not None for v in r.carrier_after.values())
    if not watched:
        return skipped(LINK_FLAP, "neither link_downed nor carrier_changes is readable", nic=nic)
    span = f"{node.interval:.1f} s"
    if grew:
        return Check(
            LINK_FLAP,
            nic,
            "",
            False,
            f"the link went down within {span}: {'; '.join(grew)}",
            "the link flaps: check the cable, transceiver and switch port (replace them if it repeats); "
            "an NCCL job aborts at each flap",
        )
    return Check(LINK_FLAP, nic, "", True, f"no link down within {span}")


def _gid_checks(r: NicRead, node: NodeRead, want: Expectations) -> list[Check]:
    """The GID NCCL uses on each RoCE port: the pinned NCCL_IB_GID_INDEX, else NCCL's own per-port
    choice (``ncclIbGetGidIndex``: NCCL_IB_GID_INDEX >= 0 is returned as is, else the table is walked
    by ``ncclUpdateGidIndex``; NVIDIA/nccl src/transport/net_ib/connect.cc). It must be a RoCE v2 GID
    of the address family, valid, and on the compute network when one is given."""
    out = []
    family, pinned = node.family, want.nccl_gid_index
    for port in r.nic.ports:
        if port.link_layer != "Ethernet":
            continue
        own = r.gid_index.get(port.number, 0)
        index = own if pinned is None else pinned
        entry = next((g for g in port.gids if g.index == index), None)
        problem = ""
        if entry is None or not gids.usable(entry, family):
            problem = f"not a RoCE v2 GID with an {family} address"
        elif want.compute_networks and not gids.on_networks(entry.gid, want.compute_networks):
            problem = f"not on the compute network ({', '.join(want.compute_networks)})"
        shown = gids.describe(port, index)
        netdev_name = entry.ndev if entry is not None and entry.ndev else (r.nic.compute_netdevs or ("<netdev>",))[0]
        if pinned is not None:
            detail = f"port {port.number}: NCCL_IB_GID_INDEX={pinned} (pinned by the deployment) is {shown}"
            if problem:
                detail += f": {problem}; NCCL's own choice here would be {gids.describe(port, own)}"
            fix = (
                "unpin NCCL_IB_GID_INDEX (NCCL then picks the GID per NIC; the plugin's workloadEnv sets it per "
                "allocation only where the allocated ports agree), or give every NIC's netdev the same addresses "
                "in the same order, so that the GID lands at the same index (show_gids lists the tables)"
            )
        else:
            detail = f"port {port.number}: NCCL ({family}) picks GID {shown}"
            if problem:
                detail += f": {problem}"
            fix = (
                f"give {netdev_name} an address of the compute network (NCCL needs a RoCE v2 GID of "
                "NCCL_IB_ADDR_FAMILY, nccl_addr_family here), or correct nccl_addr_family / compute_networks"
            )
        out.append(Check(GID_INDEX, r.nic.name, "", not problem, detail, "" if not problem else fix))
    return out


def _numa(node: NodeRead) -> list[Check]:
    nics = {r.nic.name: r.placement for r in node.nics if r.placement is not None}
    out = []
    for gpu in node.gpus:
        place = topology.placement(gpu)
        if place.numa_node is None:
            out.append(skipped(GPU_NIC_NUMA, "its NUMA node is unknown (numa_node -1)", gpu=gpu.address))
            continue
        level, names = topology.closest_nics(place, nics)
        if level is None:
            out.append(
                Check(
                    GPU_NIC_NUMA,
                    "",
                    "",
                    False,
                    f"on NUMA node {place.numa_node} has no RDMA NIC on its NUMA node",
                    "put an RDMA NIC in a slot of this NUMA node (see the node's block diagram), or check that "
                    "the BIOS NUMA setting (NPS/SNC) matches the one the node was validated with",
                    gpu=gpu.address,
                )
            )
        else:
            out.append(
                Check(
                    GPU_NIC_NUMA,
                    "",
                    "",
                    True,
                    f"NUMA node {place.numa_node}, closest NIC(s) "
                    f"{', '.join(names)} at the {level.replace('_', ' ')} level",
                    gpu=gpu.address,
                )
            )
    return out


def _topology(node: NodeRead, want: Expectations) -> list[Check]:
    expected = want.topology_expected
    if not expected:
        return []
    gpus = [topology.placement(g) for g in node.gpus]
    places = {r.nic.name: r.placement for r in node.nics}
    out = []
    for nic, wanted in sorted(expected.items()):
        place = places.get(nic)
        if place is None:
            out.append(
                Check(
                    TOPOLOGY,
                    nic,
                    "",
                    False,
                    "is not on the node (or not selected), but topology_expected names it",
                    "check the NIC (lspci) or correct topology_expected",
                )
            )
            continue
        found = set(topology.affinity(place, gpus)[topology.SWITCH])
        want_set = {a.lower() for a in wanted}
        if found == want_set:
            out.append(
                Check(TOPOLOGY, nic, "", True, f"shares its PCIe switch with {', '.join(sorted(found)) or 'no GPU'}")
            )
        else:
            out.append(
                Check(
                    TOPOLOGY,
                    nic,
                    "",
                    False,
                    f"shares its PCIe switch with {', '.join(sorted(found)) or 'no GPU'}, expected "
                    f"{', '.join(sorted(want_set)) or 'none'}",
                    "check that the NIC and GPUs sit in the slots of the node's reference layout (and that "
                    "none fell off the bus: lspci), or correct topology_expected",
                )
            )
    return out


def _gpudirect(node: NodeRead) -> Check:
    g = node.gpudirect
    if g.mode == "peermem":
        detail = f"GPUDirect RDMA through {g.peermem}"
    elif g.mode == "dma-buf":
        detail = f"GPUDirect RDMA through DMA-BUF (kernel {g.kernel}, NVIDIA open driver {g.nvidia_driver})"
    else:
        return Check(
            GPUDIRECT,
            "",
            "",
            False,
            f"no GPUDirect RDMA path: {g.why_not()}",
            "modprobe nvidia-peermem (needs MLNX_OFED/DOCA ib_core) and list it in /etc/modules-load.d/, or "
            "use the NVIDIA open kernel modules R515+ on Linux 5.12+ for DMA-BUF (NCCL_DMABUF_ENABLE=1)",
        )
    return Check(GPUDIRECT, "", "", True, detail)


def _memlock(node: NodeRead, want: Expectations) -> Check:
    if not node.runtimes:
        return skipped(MEMLOCK, "no container runtime (containerd, dockerd, crio) runs or has a systemd unit")
    rt = next((r for r in node.runtimes if r.pid is not None), node.runtimes[0])
    setting = rt.unit_setting
    unit_limit = memlock.parse_systemd(setting.value) if setting is not None and setting.value else None
    unit_text = (
        "no unit file" if setting is None else f"{rt.unit} LimitMEMLOCK={setting.value or 'unset'} ({setting.source})"
    )
    fix = (
        f"set LimitMEMLOCK=infinity in /etc/systemd/system/{rt.unit}.d/memlock.conf ([Service]), then "
        f"systemctl daemon-reload and systemctl restart {rt.unit}"
    )
    who = f"{rt.name} (pid {rt.pid})" if rt.pid is not None else rt.name
    # ib_umem_get (drivers/infiniband/core/umem.c) refuses a pin past RLIMIT_MEMLOCK only when the caller
    # lacks CAP_IPC_LOCK: pods the admission policy admits have it, so a limit then fails nothing.
    if want.ipc_lock:
        effect = (
            "RDMA pods run with CAP_IPC_LOCK (the chart's admission policy requires it), which ib_umem_get exempts "
            "from the limit, so they pin regardless; a container without it could pin no more"
        )
    else:
        effect = "RDMA pods run without CAP_IPC_LOCK (ipc_lock false), so ibv_reg_mr fails past it (ib_umem_get)"
    problem = ""
    if rt.running is not None and not rt.running.unlimited:
        problem = f"{who} runs with max locked memory {rt.running.describe()} ({unit_text})"
    elif setting is not None and (unit_limit is None or not unit_limit.unlimited):
        now = "runs unlimited now, but" if rt.running is not None else "does not run, and"
        problem = f"{who} {now} {unit_text} limits locked memory after a restart"
    if problem:
        if want.ipc_lock:
            return warning(MEMLOCK, "", f"{problem}: {effect}", fix, label="")
        return Check(MEMLOCK, "", "", False, f"{problem}: {effect}", fix, label="")
    if rt.running is None and setting is None:
        return skipped(MEMLOCK, f"{who}: {rt.running_source} and no unit file")
    state = "runs with unlimited locked memory" if rt.running is not None else "is not running"
    return Check(MEMLOCK, "", "", True, f"{who} {state}; {unit_text}", label="")


def _perftest_checks(r: NicRead, want: Expectations) -> list[Check]:
    out = []
    for port in r.nic.ports:
        result = r.perftest.get(port.number)
        if result is None:
            if not port.active:
                out.append(skipped(PERFTEST, f"port {port.number} is {port.state}", nic=r.nic.name))
            continue
        rate = port.rate_gbps
        if result.gbps is None:
            out.append(
                Check(
                    PERFTEST,
                    r.nic.name,
                    "",
                    False,
                    f"port {port.number} loopback failed: {result.error}",
                    f"run {' '.join(result.command)} by hand with the server half alongside; check the port "
                    "and that no other job holds the NIC",
                )
            )
            continue
        detail = f"port {port.number} loopback {result.gbps:g} Gb/s"
        if rate is None:
            out.append(
                skipped(PERFTEST, f"{detail}, but the port rate is unknown (ports/{port.number}/rate)", r.nic.name)
            )
            continue
        ok = result.gbps >= rate * want.perftest_min_percent / 100
        detail += f" of {rate:g} Gb/s ({100 * result.gbps / rate:.1f} %, need {want.perftest_min_percent:g} %)"
        out.append(
            Check(
                PERFTEST,
                r.nic.name,
                "",
                ok,
                detail,
                ""
                if ok
                else "check the PCIe link (pcie_link), the port speed and errors, the NIC's NUMA "
                "placement and its firmware; rerun when the node is idle",
            )
        )
    return out


def check(node: NodeRead, want: Expectations) -> list[Check]:
    """Every health check of one node read: per NIC, then node-wide, then per GPU."""
    out: list[Check] = []
    for r in node.nics:
        out += [_pcie(PCIE_LINK, r.nic.name, "", f, width_only=False) for f in r.functions]
        below = r.functions[0].address if r.functions else r.nic.pci_address
        out += [_pcie(PCIE_LINK, r.nic.name, "", b, width_only=False, below=below) for b in r.links]
        if not r.functions:
            out.append(skipped(PCIE_LINK, f"no PCI function {r.nic.pci_address} under /sys/bus/pci", nic=r.nic.name))
        out.append(_mtu(r, want))
        if r.ethernet:
            out.append(_link(r))
            out += _bond(r, want)
            out += _qos(r, want)
        out += _counters(r, node, want)
        out.append(_flap(r, node, want))
        out += _gid_checks(r, node, want)
        if want.perftest:
            if node.perftest:
                out.append(skipped(PERFTEST, node.perftest, nic=r.nic.name))
            else:
                out += _perftest_checks(r, want)
    eth = [r for r in node.nics if r.ethernet]
    if len(eth) > 1:
        out.append(_mtu_consistency(eth, want))
    out += _topology(node, want)
    if want.gpudirect_required:
        out.append(_gpudirect(node))
    out.append(_memlock(node, want))
    for gpu in node.gpus:
        out.append(_pcie(GPU_PCIE_LINK, "", gpu.address, gpu, width_only=True))
    for bridge in node.gpu_links:
        gpu = next(g for g in node.gpus if bridge.address in g.path)
        out.append(_pcie(GPU_PCIE_LINK, "", gpu.address, bridge, width_only=True, below=gpu.address))
    out += _numa(node)
    out = [c for c in out if c.name not in want.skip]
    if want.fail_not_checked:
        out = [strict(c, "provide the source the message names, or leave the check out (skip_checks)") for c in out]
    return out


def _mtu_consistency(eth: Sequence[NicRead], want: Expectations) -> Check:
    seen = {}
    for r in eth:
        owner = r.nic.compute_netdevs[0] if r.nic.compute_netdevs else ""
        mtu = r.netdevs[owner].mtu if owner in r.netdevs else None
        active = sorted(set(r.active_mtu.values())) if r.active_mtu else [roce_active_mtu(mtu or 0)]
        seen[r.nic.name] = (mtu, tuple(active))

    def shown(v: tuple[int | None, tuple[int, ...]]) -> str:
        return f"MTU {v[0]}/RoCE {'/'.join(map(str, v[1]))}"

    return same_across_nics(
        MTU_CONSISTENT,
        seen,
        lambda odd, common: (
            f"MTU differs across NICs: {', '.join(f'{n}={shown(v)}' for n, v in odd.items())} "
            f"while the others have {shown(common)}"
        ),
        lambda common: f"every NIC has MTU {common[0]}, RoCE active MTU {'/'.join(map(str, common[1]))}",
        "give every RoCE netdev the same MTU (a path runs at the smallest)",
    )


def next_baseline(node: NodeRead, want: Expectations) -> dict[str, Any]:
    """The counters this run stores for the next one: per NIC its latest values, or, for a NIC whose
    ``counter_max`` counters grew past their limit since the previous values, those previous values
    (the NIC keeps failing until its counters are reset or the stored file is removed: a repair
    that is not followed by a reset would otherwise pass the next run unseen)."""
    nics: dict[str, Any] = {}
    for r in node.nics:
        old = (node.baseline.get("nics") or {}).get(r.nic.name)
        if old is not None and baseline_growth(r, node, want):
            nics[r.nic.name] = old
            continue
        ports = {str(p): v for p, v in r.latest_counters.items() if v}
        # taken: when the latest values were read (the first read may be a sample the node kept long before)
        nics[r.nic.name] = {"node_guid": r.nic.node_guid, "taken": round(node.taken + node.interval, 3), "ports": ports}
    return {"nics": nics}


def summary(node: NodeRead, checks: Sequence[Check]) -> dict[str, object]:
    """The report row: what the node has, and which checks failed or were not checked."""
    gpus = [topology.placement(g) for g in node.gpus]
    degraded = sorted({c.gpu or c.nic for c in checks if c.name in (PCIE_LINK, GPU_PCIE_LINK) and not c.passed})
    running = next((r for r in node.runtimes if r.running is not None), None)
    return {
        "health": "failed" if any(not c.passed for c in checks) else "passed",
        "not_checked": sorted({c.name for c in checks if c.skipped}),
        "gpus": len(node.gpus),
        "gid_index": {r.nic.name: r.gid_index.get(1) for r in node.nics},
        "gid_family": node.family if any(r.ethernet for r in node.nics) else None,
        "mtu": {
            r.nic.name: r.netdevs[r.nic.compute_netdevs[0]].mtu
            for r in node.nics
            if r.ethernet and r.nic.compute_netdevs and r.nic.compute_netdevs[0] in r.netdevs
        },
        "bonds": {r.nic.name: r.bond.mode for r in node.nics if r.bond is not None},
        "pcie_degraded": degraded,
        "topology": {
            r.nic.name: {k: list(v) for k, v in topology.affinity(r.placement, gpus).items()}
            for r in node.nics
            if r.placement is not None and gpus
        },
        "gpudirect": node.gpudirect.mode or "none",
        "kernel": node.gpudirect.kernel or None,  # osrelease: the fleet report's kernel drift
        "memlock": None if running is None or running.running is None else running.running.describe(),
    }


def details(node: NodeRead) -> dict[str, object]:
    """Everything the read saw (the module returns it with ``details``)."""
    return {
        "interval": node.interval,
        "dcb": node.dcb or "used",
        "perftest": node.perftest or None,
        "nics": {
            r.nic.name: {
                "pci": [f.to_dict() for f in r.functions],
                "netdevs": {
                    n: {
                        "mtu": d.mtu,
                        "operstate": d.operstate,
                        "carrier": d.carrier,
                        "carrier_changes": d.carrier_changes,
                        "master": d.master or None,
                    }
                    for n, d in r.netdevs.items()
                },
                "bond": None if r.bond is None else r.bond.to_dict(),
                "qos": {n: q.to_dict() for n, q in r.qos.items()},
                "counters": {str(p): v for p, v in r.counters.items()},
                "gid_index": {str(p): i for p, i in r.gid_index.items()},
                "perftest": {str(p): {"gbps": res.gbps, "error": res.error or None} for p, res in r.perftest.items()},
            }
            for r in node.nics
        },
        "gpus": [g.to_dict() for g in node.gpus],
        "gpudirect": node.gpudirect.to_dict(),
        "runtimes": [rt.to_dict() for rt in node.runtimes],
    }
