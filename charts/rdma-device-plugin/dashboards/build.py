#!/usr/bin/env python3
"""The chart's Grafana dashboard, built with grafana-foundation-sdk (Grafana's own typed builders)
rather than hand-written JSON. Writes ``files/dashboards/rdma-device-plugin.json``; the chart test
``test_dashboard_is_generated`` fails when the committed file differs from what this builds.

    .venv/bin/python charts/rdma-device-plugin/dashboards/build.py          # rewrite the JSON
    .venv/bin/python charts/rdma-device-plugin/dashboards/build.py --check  # exit 1 on drift

Placeholders the chart's templates/dashboard.yaml fills per release: ``__SELECTOR__`` (the PromQL
matchers of metrics.jobSelector, JSON-escaped), ``__RDMA_NODES__`` (the nodes that should run a
plugin, one series per node: kube-state-metrics' kube_node_labels as the alerts read them, or the
plugin targets without kube-state-metrics), ``__UID__`` (a uid per namespace and release: two
releases in one Grafana do not collide) and ``__RELEASE__`` (in the title, unique per folder).

At 2,000 nodes: the fleet row aggregates (sums per resource, fleet quantiles, top 10 nodes), never
one line per node; its tables list only the nodes that are not ready. The per-NIC panels are in the
node row, for the nodes picked in ``node``.

Conventions of the Kubernetes mixins: a ``cluster`` variable (all by default: ``.*`` also matches
series without the label, so a single cluster needs nothing), a ``node`` variable, rates over
``$__rate_interval``, and tables from instant queries in table format with the labels as columns
(merged per node, renamed, the Time column hidden), so Grafana shows one row per node or NIC.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TypeVar

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

P = TypeVar("P", stat.Panel, table.Panel, timeseries.Panel)
OUT = Path(__file__).resolve().parent.parent / "files" / "dashboards" / "rdma-device-plugin.json"
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = "__SELECTOR__"
FLEET = f'{SEL},cluster=~"$cluster"'
NODE = f'{SEL},cluster=~"$cluster",node=~"$node"'
RDMA_NODES = "__RDMA_NODES__"  # one series per node that should run a plugin (cluster filter included)


def q(expr: str, ref: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if instant:  # a table row per series; a legend names a stat's value
        query = query.instant().format(PromQueryFormat.TABLE)
        return query.legend_format(legend) if legend else query
    return query.range().legend_format(legend or "__auto")


def organize(rename: dict[str, str], hide: tuple[str, ...] = ("Time",)) -> dm.DataTransformerConfig:
    return dm.DataTransformerConfig(
        id_val="organize",
        options={"excludeByName": dict.fromkeys(hide, True), "renameByName": rename, "indexByName": {}},
    )


MERGE = dm.DataTransformerConfig(id_val="merge", options={})


def ts() -> timeseries.Panel:
    """A time series panel with its legend as a table below (labels readable, series sortable)."""
    legend = (
        cb.VizLegendOptions()
        .show_legend(True)
        .display_mode(cm.LegendDisplayMode.TABLE)
        .placement(cm.LegendPlacement.BOTTOM)
    )
    return timeseries.Panel().legend(legend)


# Per node, as in the alerts: ready = plugin scraped, every resource registered, a Healthy device.
READY = (
    f"(min by (node) (up{{{FLEET}}}) == 1)"
    f" * on(node) (min by (node) (rdma_dp_resource_registered{{{FLEET}}}))"
    f' * on(node) clamp_max(sum by (node) (rdma_dp_devices{{{FLEET},health="Healthy"}}), 1)'
)
# The nodes that should run a plugin and cannot take RDMA pods: no plugin, down, unregistered, nothing
# Healthy (RdmaFleetNotReady's set), one series per node.
NOT_READY = f"({RDMA_NODES} unless on(node) (({READY}) == 1))"
SELECTED = f'rdma_dp_nic_info{{{FLEET},resource!=""}}'
LINK_ERRORS = (
    "symbol_errors|receive_errors|receive_remote_physical_errors|link_error_recoveries|"
    "local_link_integrity_errors|excessive_buffer_overrun_errors"
)


def rate(metric: str, where: str = NODE) -> str:
    return f"rate({metric}{{{where}}}[$__rate_interval])"


def link_errors(where: str) -> str:
    """The per-second rate of every link error counter of every port, each with a ``counter`` label: rate()
    drops the metric name, and several counters' series with the same labels are an evaluation error."""
    return " or ".join(
        f'label_replace({rate(f"rdma_dp_port_{name}_total", where)}, "counter", "{name}", "", "")'
        for name in LINK_ERRORS.split("|")
    )


# Selected ports (of NICs a pool selects) not ACTIVE, per node.
PORTS_DOWN = f"sum by (node) ((1 - rdma_dp_port_active{{{FLEET}}}) * on(job, instance, nic) group_left() {SELECTED})"


def build() -> dict[str, object]:
    panel_id = iter(range(1, 100))  # ids in layout order: Grafana links and repeats refer to them

    def place(panel: P, title: str, width: int, height: int) -> P:
        """The next id, the title, the data source and the size (24 columns make a row)."""
        return panel.id(next(panel_id)).title(title).datasource(DS).span(width).height(height)

    def series(title: str, width: int, by: str, *lines: tuple[str, str]) -> timeseries.Panel:
        """A time series panel, 8 high, one query per (expression, legend); each legend starts with
        the grouping labels ``by`` ("node, resource" -> "{{node}} {{resource}} <legend>")."""
        panel = place(ts(), title, width, 8)
        prefix = " ".join("{{" + label.strip() + "}}" for label in by.split(",") if label.strip())
        for ref, (expr, legend) in zip("ABCDEF", lines, strict=False):
            panel = panel.with_target(q(expr, ref, f"{prefix} {legend}".rstrip()))
        return panel

    fleet_row = db.Row("Fleet").id(next(panel_id))
    fleet_ready = (
        place(stat.Panel(), "Nodes RDMA-ready", 6, 6)
        .description(
            "RDMA nodes (kube-state-metrics' node labels, as the alerts read them) whose plugin is scraped, has "
            "every resource registered and a Healthy device; not ready: every other RDMA node, those without a "
            "plugin or whose plugin is down included."
        )
        .with_target(
            q(f"count(({READY}) == 1) or vector(0)", "A", "ready", instant=True).format(PromQueryFormat.TIME_SERIES)
        )
        .with_target(
            q(f"count({NOT_READY}) or vector(0)", "B", "not ready", instant=True).format(PromQueryFormat.TIME_SERIES)
        )
        .graph_mode(cm.BigValueGraphMode.NONE)
        .color_mode(cm.BigValueColorMode.VALUE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    readiness = (
        place(table.Panel(), "Nodes not RDMA-ready", 18, 6)
        .description(
            "One row per RDMA node that cannot take RDMA pods (only those: a fleet of 2,000 lists a few rows): "
            "scraped, registered, Healthy and all devices, selected ports not ACTIVE. Empty cells: no plugin there."
        )
        .with_target(q(f"max by (node) ({NOT_READY})", "A", instant=True))
        .with_target(q(f"min by (node) (up{{{FLEET}}}) and on(node) {NOT_READY}", "B", instant=True))
        .with_target(
            q(f"min by (node) (rdma_dp_resource_registered{{{FLEET}}}) and on(node) {NOT_READY}", "C", instant=True)
        )
        .with_target(
            q(
                f'sum by (node) (rdma_dp_devices{{{FLEET},health="Healthy"}}) and on(node) {NOT_READY}',
                "D",
                instant=True,
            )
        )
        .with_target(q(f"sum by (node) (rdma_dp_devices{{{FLEET}}}) and on(node) {NOT_READY}", "E", instant=True))
        .with_target(
            q(
                f"{PORTS_DOWN} and on(node) {NOT_READY}",
                "F",
                instant=True,
            )
        )
        .show_header(True)
        .with_transformation(MERGE)
        .with_transformation(
            organize(
                {
                    "node": "Node",
                    "Value #B": "Scraped",
                    "Value #C": "Registered",
                    "Value #D": "Healthy devices",
                    "Value #E": "Devices",
                    "Value #F": "Ports not ACTIVE",
                },
                ("Time", "Value #A"),
            )
        )
    )
    capacity = series(
        "Allocatable vs capacity, fleet",
        12,
        "resource",
        (f'sum by (resource) (rdma_dp_devices{{{FLEET},health="Healthy"}})', "allocatable"),
        (f"sum by (resource) (rdma_dp_devices{{{FLEET}}})", "capacity"),
    ).description("Summed over the nodes: a drop of allocatable below capacity is NICs going Unhealthy somewhere.")
    degraded = series(
        "Nodes degraded",
        12,
        "",
        (f"count({NOT_READY}) or vector(0)", "not RDMA-ready"),
        (
            f'count(sum by (node) (rdma_dp_devices{{{FLEET},health="Unhealthy"}}) > 0) or vector(0)',
            "with Unhealthy devices",
        ),
        (
            f'count(max by (node, resource) (rdma_dp_pool_nics{{{FLEET},health="Unhealthy"}}) > 0) or vector(0)',
            "with a NIC down or gone",
        ),
        (
            f"count({PORTS_DOWN} > 0) or vector(0)",
            "with a selected port not ACTIVE",
        ),
    ).description("Counts of nodes, not one line per node: the per-node warnings name them.")
    allocations = series(
        "Allocations",
        8,
        "resource, result",
        (f"sum by (resource, result) ({rate('rdma_dp_allocations_total', FLEET)})", ""),
    ).unit("reqps")
    latency = (
        series(
            "Allocate latency, fleet (p50, p99)",
            8,
            "resource",
            (
                f"histogram_quantile(0.5, sum by (le, resource) ({rate('rdma_dp_allocate_seconds_bucket', FLEET)}))",
                "p50",
            ),
            (
                f"histogram_quantile(0.99, sum by (le, resource) ({rate('rdma_dp_allocate_seconds_bucket', FLEET)}))",
                "p99",
            ),
        )
        .description("The plugin creates the histogram at start: empty (NaN) until the first Allocate, never missing.")
        .unit("s")
    )
    churn = series(
        "Re-registrations and stream ends, fleet",
        8,
        "resource",
        (f"sum by (resource) (increase(rdma_dp_registrations_total{{{FLEET}}}[$__rate_interval]))", "registrations"),
        (f"sum by (resource) (increase(rdma_dp_stream_ends_total{{{FLEET}}}[$__rate_interval]))", "stream ends"),
    )
    throughput = series(
        "RDMA throughput, fleet",
        8,
        "",
        (f"sum(8 * {rate('rdma_dp_port_receive_bytes_total', FLEET)})", "receive"),
        (f"sum(8 * {rate('rdma_dp_port_transmit_bytes_total', FLEET)})", "transmit"),
    ).unit("bps")
    congestion_top = series(
        "Top 10 nodes by congestion (ECN-marked + CNP sent)",
        8,
        "node",
        (
            f"topk(10, sum by (node) ({rate('rdma_dp_port_ecn_marked_packets_total', FLEET)}"
            f" + {rate('rdma_dp_port_cnp_sent_packets_total', FLEET)}))",
            "",
        ),
    ).unit("pps")
    errors_top = series(
        "Top 10 nodes by link errors",
        8,
        "node",
        (
            f"topk(10, sum by (node) ({link_errors(FLEET)}))",
            "",
        ),
    ).description("Symbol, receive, remote physical, link recovery, integrity and overrun errors (RdmaNicPortErrors).")
    node_row = db.Row("Node $node").id(next(panel_id))
    port_states = (
        place(table.Panel(), "Port states", 12, 8)
        .description("One row per port of every NIC the plugin found on the node (selected or not).")
        .show_header(True)
        .with_target(q(f"max by (node, nic, port, state) (rdma_dp_port_state{{{NODE}}} == 1)", "A", instant=True))
        .with_transformation(
            organize({"node": "Node", "nic": "NIC", "port": "Port", "state": "State"}, ("Time", "Value"))
        )
    )
    nics = (
        place(table.Panel(), "NICs", 12, 8)
        .description("Every RDMA NIC on the node and the pool (resource) that selects it; empty: no pool.")
        .show_header(True)
        .with_target(
            q(
                "max by (node, nic, pci_address, link_layer, netdev, numa_node, resource) "
                f"(rdma_dp_nic_info{{{NODE}}})",
                "A",
                instant=True,
            )
        )
        .with_transformation(
            organize(
                {
                    "node": "Node",
                    "nic": "NIC",
                    "pci_address": "PCI address",
                    "link_layer": "Link layer",
                    "netdev": "Netdev",
                    "numa_node": "NUMA node",
                    "resource": "Pool",
                },
                ("Time", "Value"),
            )
        )
    )
    devices = series(
        "Devices by health",
        8,
        "node, resource, health",
        (f"sum by (node, resource, health) (rdma_dp_devices{{{NODE}}})", ""),
    )
    registered = series(
        "Registered and stream open",
        8,
        "node, resource",
        (f"max by (node, resource) (rdma_dp_resource_registered{{{NODE}}})", "registered"),
        (f"max by (node, resource) (rdma_dp_kubelet_stream_open{{{NODE}}})", "stream open"),
    )
    loops = series(
        "Seconds since each loop last ran",
        8,
        "node, loop",
        (f"time() - max by (node, loop) (rdma_dp_loop_last_success_timestamp_seconds{{{NODE}}})", ""),
    ).unit("s")
    nic_throughput = series(
        "Throughput per NIC",
        8,
        "node, nic",
        (f"sum by (node, nic) (8 * {rate('rdma_dp_port_receive_bytes_total')})", "receive"),
        (f"sum by (node, nic) (8 * {rate('rdma_dp_port_transmit_bytes_total')})", "transmit"),
    ).unit("bps")
    nic_congestion = series(
        "Congestion per NIC",
        8,
        "node, nic",
        (f"sum by (node, nic) ({rate('rdma_dp_port_ecn_marked_packets_total')})", "ECN-marked"),
        (f"sum by (node, nic) ({rate('rdma_dp_port_cnp_sent_packets_total')})", "CNP sent"),
        (f"sum by (node, nic) ({rate('rdma_dp_port_cnp_handled_packets_total')})", "CNP handled"),
        (f"sum by (node, nic) ({rate('rdma_dp_port_transmit_wait_ticks_total')})", "transmit wait"),
    ).description("ECN marks and congestion notifications (RoCE, DCQCN) and transmit wait (InfiniBand credits).")
    nic_errors = series(
        "Errors and retransmits per NIC",
        8,
        "node, nic",
        (
            f"sum by (node, nic) ({link_errors(NODE)})",
            "link errors",
        ),
        (f"sum by (node, nic) ({rate('rdma_dp_port_out_of_sequence_packets_total')})", "out of sequence"),
        (f"sum by (node, nic) ({rate('rdma_dp_port_local_ack_timeouts_total')})", "ACK timeouts"),
        (
            f"sum by (node, nic) (increase(rdma_dp_port_state_changes_total{{{NODE}}}[$__rate_interval]))",
            "state changes",
        ),
    ).description("Lost packets show as out of sequence and ACK timeouts (retransmits); flaps as state changes.")
    dash = (
        db.Dashboard("RDMA device plugin (__RELEASE__)")
        .uid("__UID__")
        .description("RDMA device plugin: fleet readiness and one node's NICs, ports and kubelet registration.")
        .tags(["rdma", "device-plugin"])
        .editable()
        .time("now-6h", "now")
        .refresh("30s")
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            db.QueryVariable("cluster")
            .label("Cluster")
            .datasource(DS)
            .query(f"label_values(rdma_dp_build_info{{{SEL}}}, cluster)")
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
        .with_variable(
            db.QueryVariable("node")
            .label("Node")
            .datasource(DS)
            .query(f'label_values(rdma_dp_build_info{{{SEL},cluster=~"$cluster"}}, node)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")  # not a regex of 2,000 names
            .multi(True)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
        .with_row(fleet_row)
        .with_panel(fleet_ready)
        .with_panel(readiness)
        .with_panel(capacity)
        .with_panel(degraded)
        .with_panel(allocations)
        .with_panel(latency)
        .with_panel(churn)
        .with_panel(throughput)
        .with_panel(congestion_top)
        .with_panel(errors_top)
        .with_row(node_row)
        .with_panel(port_states)
        .with_panel(nics)
        .with_panel(devices)
        .with_panel(registered)
        .with_panel(loops)
        .with_panel(nic_throughput)
        .with_panel(nic_congestion)
        .with_panel(nic_errors)
    )
    doc: dict[str, object] = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    return doc


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is out of date: run {Path(__file__).name} without --check", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
