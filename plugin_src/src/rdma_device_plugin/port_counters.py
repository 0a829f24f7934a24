"""The NICs' own port counters as Prometheus counters, read from sysfs at scrape time only.

A :class:`PortCountersCollector` is a prometheus_client custom collector: ``collect()`` runs when
Prometheus scrapes and reads each port's ``counters/`` and ``hw_counters/`` through the one reader
(:func:`node.portcounters.read_port`); between scrapes it holds nothing and reads nothing, so a
plugin nobody scrapes pays nothing. Only the counters of :data:`COUNTERS` are exported (one metric
family each, labels ``nic`` and ``port``), a NIC or port that lacks a file simply has no series of
it: the PortCounters of ``counters/`` exist on every port (InfiniBand and RoCE, kernel
drivers/infiniband/core/sysfs.c, ``pma_attrs*``), the ``hw_counters/`` ones are mlx5's
(drivers/infiniband/hw/mlx5/counters.c: ``basic_q_cnts``/``out_of_seq_q_cnts``/``retrans_q_cnts``,
``roce_accl_cnts``, ``cong_cnts``).

Units, as the kernel documents them (Documentation/ABI/stable/sysfs-class-infiniband):
``port_xmit_data``/``port_rcv_data`` count octets divided by 4, so the bytes metrics are the value
times 4.

Saturation: InfiniBand PortCounters do not wrap, they stop at their maximum (IBTA PortCounters,
"saturating"); sysfs.c declares each one's width (``PORT_PMA_ATTR(name, counter, width, offset)``):
``local_link_integrity_errors`` and ``excessive_buffer_overrun_errors`` are 4 bits (stop at 15),
``link_downed``/``link_error_recovery``/the constraint errors 8, the error counters 16, the data and
packet counters 32 on ports without the extended (64-bit) set. A counter stuck at its maximum shows
a rate of 0 while the errors go on, so :data:`SATURATED` marks it (``rdma_dp_port_counter_saturated``
1, present only then) and the chart's error alert fires on it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .node import portcounters
from .node.sysfs import Nic

SATURATED = "rdma_dp_port_counter_saturated"


@dataclass(frozen=True)
class CounterSpec:
    """One kernel counter file and the metric it becomes (``rdma_dp_port_<metric>_total``)."""

    kernel: str  # file name under ports/<n>/counters/ or hw_counters/
    metric: str
    help: str
    scale: int = 1  # value x scale: port_*_data counts 4-octet words
    width: int = 0  # PortCounters width in bits (saturates at 2**width - 1); 0: 64-bit, not marked

    @property
    def name(self) -> str:
        return f"rdma_dp_port_{self.metric}"

    @property
    def maximum(self) -> int | None:
        return (1 << self.width) - 1 if self.width else None


# The kernel's names (left) and their widths from sysfs.c's PORT_PMA_ATTR declarations.
COUNTERS: tuple[CounterSpec, ...] = (
    # traffic (counters/)
    CounterSpec("port_xmit_data", "transmit_bytes", "Bytes transmitted on all VLs (port_xmit_data x 4)", 4, 32),
    CounterSpec("port_rcv_data", "receive_bytes", "Bytes received on all VLs (port_rcv_data x 4)", 4, 32),
    CounterSpec("port_xmit_packets", "transmit_packets", "Packets transmitted (port_xmit_packets)", 1, 32),
    CounterSpec("port_rcv_packets", "receive_packets", "Packets received (port_rcv_packets)", 1, 32),
    # congestion and drops
    CounterSpec(
        "port_xmit_wait", "transmit_wait_ticks", "Ticks the port had data to send but sent none (port_xmit_wait)", 1, 32
    ),
    CounterSpec("port_xmit_discards", "transmit_discards", "Outbound packets discarded (port_xmit_discards)", 1, 16),
    CounterSpec("np_ecn_marked_roce_packets", "ecn_marked_packets", "RoCE packets received ECN-marked (mlx5)"),
    CounterSpec("np_cnp_sent", "cnp_sent_packets", "Congestion notification packets sent (mlx5)"),
    CounterSpec("rp_cnp_handled", "cnp_handled_packets", "Congestion notification packets handled (mlx5)"),
    CounterSpec("rp_cnp_ignored", "cnp_ignored_packets", "Congestion notification packets ignored (mlx5)"),
    CounterSpec("out_of_buffer", "out_of_buffer_drops", "Packets dropped for lack of receive WQEs (mlx5)"),
    # link and physical errors (counters/)
    CounterSpec("symbol_error", "symbol_errors", "Minor link errors on any physical lane (symbol_error)", 1, 16),
    CounterSpec("link_error_recovery", "link_error_recoveries", "Link error recovery processes completed", 1, 8),
    CounterSpec("link_downed", "link_downed", "Times the link error recovery failed and the link went down", 1, 8),
    CounterSpec("port_rcv_errors", "receive_errors", "Packets received with an error (port_rcv_errors)", 1, 16),
    CounterSpec(
        "port_rcv_remote_physical_errors",
        "receive_remote_physical_errors",
        "Packets received marked with the EBP delimiter",
        1,
        16,
    ),
    CounterSpec(
        "local_link_integrity_errors",
        "local_link_integrity_errors",
        "Times local physical errors exceeded their threshold (4 bits: stops at 15)",
        1,
        4,
    ),
    CounterSpec(
        "excessive_buffer_overrun_errors",
        "excessive_buffer_overrun_errors",
        "Consecutive flow-control update periods with buffer overruns (4 bits: stops at 15)",
        1,
        4,
    ),
    # transport (hw_counters/, mlx5): out of sequence, retransmits and their causes
    CounterSpec("out_of_sequence", "out_of_sequence_packets", "Out-of-sequence packets received (mlx5)"),
    CounterSpec("packet_seq_err", "packet_sequence_errors", "NAK sequence errors received (mlx5)"),
    CounterSpec(
        "duplicate_request", "duplicate_requests", "Duplicate requests received: the peer retransmitted (mlx5)"
    ),
    CounterSpec("local_ack_timeout_err", "local_ack_timeouts", "ACK timeouts: this side retransmitted (mlx5)"),
    CounterSpec("implied_nak_seq_err", "implied_nak_sequence_errors", "Implied NAK sequence errors (mlx5)"),
    CounterSpec("rnr_nak_retry_err", "rnr_nak_retry_errors", "RNR NAK retries exceeded (mlx5)"),
    CounterSpec("roce_adp_retrans", "adaptive_retransmits", "RoCE adaptive retransmissions (mlx5)"),
    CounterSpec("roce_slow_restart", "slow_restarts", "RoCE slow restarts (mlx5)"),
)
KERNEL_NAMES = tuple(c.kernel for c in COUNTERS)


def ports_of(nics: Sequence[Nic]) -> list[tuple[str, int]]:
    """(NIC name, port number) of every port of ``nics``, sorted."""
    return sorted((nic.name, port.number) for nic in nics for port in nic.ports)


def families(values: dict[tuple[str, int], dict[str, int]]) -> Iterator[Metric]:
    """The metric families of the counters read per (nic, port) (pure: no I/O)."""
    saturated = GaugeMetricFamily(
        SATURATED,
        "1 while a port counter stands at the maximum of its width: InfiniBand PortCounters stop there, so its "
        "rate reads 0 while the errors go on (labels: the kernel's counter name)",
        labels=["nic", "port", "counter"],
    )
    for spec in COUNTERS:
        family = CounterMetricFamily(spec.name, spec.help, labels=["nic", "port"])
        for (nic, port), read in sorted(values.items()):
            value = read.get(spec.kernel)
            if value is None:
                continue
            family.add_metric([nic, str(port)], value * spec.scale)
            if value == spec.maximum:  # ==, not >=: a 64-bit (extended) data counter goes past 2**32 - 1
                saturated.add_metric([nic, str(port), spec.kernel], 1)
        yield family
    yield saturated


class PortCountersCollector(Collector):
    """Reads the counters of every port of ``nics()`` at each scrape (and only then)."""

    def __init__(self, sysfs_root: str, nics: Callable[[], Sequence[Nic]]) -> None:
        self.sysfs_root = sysfs_root
        self.nics = nics

    def describe(self) -> list[Metric]:
        return []  # registering must not read the device: describe nothing, collect at scrape time

    def collect(self) -> Iterator[Metric]:
        read = portcounters.read_port
        yield from families({(nic, p): read(self.sysfs_root, nic, p, KERNEL_NAMES) for nic, p in ports_of(self.nics())})
