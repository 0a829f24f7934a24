#!/usr/bin/env python3
"""The chart's Grafana dashboard, built with grafana-foundation-sdk (Grafana's own typed builders)
rather than hand-written JSON. Writes ``files/dashboards/rdma-device-plugin.json``; the chart test
``test_dashboard_is_generated`` fails when the committed file differs from what this builds.

    .venv/bin/python charts/rdma-device-plugin/dashboards/build.py          # rewrite the JSON
    .venv/bin/python charts/rdma-device-plugin/dashboards/build.py --check  # exit 1 on drift

Placeholders the chart's templates/dashboard.yaml fills per release: ``__SELECTOR__`` (the PromQL
matchers of metrics.jobSelector, JSON-escaped), ``__UID__`` (a uid per namespace and release: two
releases in one Grafana do not collide) and ``__RELEASE__`` (in the title, unique per folder).

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


def q(expr: str, ref: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    if instant:
        return query.instant().format(PromQueryFormat.TABLE)
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


def build() -> dict[str, object]:
    panel_id = iter(range(1, 100))  # ids in layout order: Grafana links and repeats refer to them

    def place(panel: P, title: str, width: int, height: int) -> P:
        """The next id, the title, the data source and the size (24 columns make a row)."""
        return panel.id(next(panel_id)).title(title).datasource(DS).span(width).height(height)

    def series(title: str, width: int, by: str, *lines: tuple[str, str]) -> timeseries.Panel:
        """A time series panel, 8 high, one query per (expression, legend); each legend starts with
        the grouping labels ``by`` ("node, resource" -> "{{node}} {{resource}} <legend>")."""
        panel = place(ts(), title, width, 8)
        prefix = " ".join("{{" + label.strip() + "}}" for label in by.split(","))
        for ref, (expr, legend) in zip("ABCDEF", lines, strict=False):
            panel = panel.with_target(q(expr, ref, f"{prefix} {legend}".rstrip()))
        return panel

    fleet_row = db.Row("Fleet").id(next(panel_id))
    fleet_ready = (
        place(stat.Panel(), "Nodes RDMA-ready", 6, 6)
        .description(
            "Nodes whose plugin is scraped, has every resource registered and a Healthy device; and those that are not."
        )
        .with_target(q(f"sum({READY})", "A", "ready", instant=True).format(PromQueryFormat.TIME_SERIES))
        .with_target(
            q(f"count(({READY}) == 0) or vector(0)", "B", "not ready", instant=True).format(PromQueryFormat.TIME_SERIES)
        )
        .graph_mode(cm.BigValueGraphMode.NONE)
        .color_mode(cm.BigValueColorMode.VALUE)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    readiness = (
        place(table.Panel(), "RDMA readiness by node", 18, 6)
        .description(
            "One row per node: scraped, registered, Healthy and all devices, selected ports not ACTIVE, "
            "plugin version and mode."
        )
        .with_target(q(f"min by (node) (up{{{FLEET}}})", "A", instant=True))
        .with_target(q(f"min by (node) (rdma_dp_resource_registered{{{FLEET}}})", "B", instant=True))
        .with_target(q(f'sum by (node) (rdma_dp_devices{{{FLEET},health="Healthy"}})', "C", instant=True))
        .with_target(q(f"sum by (node) (rdma_dp_devices{{{FLEET}}})", "D", instant=True))
        .with_target(
            q(
                f"sum by (node) ((1 - rdma_dp_port_active{{{FLEET}}})"
                f' * on(job, instance, nic) group_left() rdma_dp_nic_info{{{FLEET},resource!=""}})',
                "E",
                instant=True,
            )
        )
        .with_target(q(f"max by (node, version, mode) (rdma_dp_build_info{{{FLEET}}})", "F", instant=True))
        .show_header(True)
        .with_transformation(MERGE)
        .with_transformation(
            organize(
                {
                    "node": "Node",
                    "Value #A": "Scraped",
                    "Value #B": "Registered",
                    "Value #C": "Healthy devices",
                    "Value #D": "Devices",
                    "Value #E": "Ports not ACTIVE",
                    "version": "Version",
                    "mode": "Mode",
                },
                ("Time", "Value #F"),
            )
        )
    )
    ports_down = series(
        "NIC ports not ACTIVE by node",
        12,
        "node",
        (
            (
                f"sum by (node) ((1 - rdma_dp_port_active{{{FLEET}}})"
                f' * on(job, instance, nic) group_left() rdma_dp_nic_info{{{FLEET},resource!=""}})'
            ),
            "",
        ),
    ).description('Ports of NICs a pool selects (rdma_dp_nic_info resource != ""); unused NICs are left out.')
    capacity = series(
        "Allocatable vs capacity per node",
        12,
        "node, resource",
        (f'sum by (node, resource) (rdma_dp_devices{{{FLEET},health="Healthy"}})', "allocatable"),
        (f"sum by (node, resource) (rdma_dp_devices{{{FLEET}}})", "capacity"),
    )
    allocations = series(
        "Allocations",
        8,
        "node, resource, result",
        (f"sum by (node, resource, result) (rate(rdma_dp_allocations_total{{{FLEET}}}[$__rate_interval]))", ""),
    ).unit("reqps")
    latency = (
        series(
            "Allocate latency (p99)",
            8,
            "node, resource",
            (
                (
                    "histogram_quantile(0.99, sum by (le, node, resource) "
                    f"(rate(rdma_dp_allocate_seconds_bucket{{{FLEET}}}[$__rate_interval])))"
                ),
                "",
            ),
        )
        .description("The plugin creates the histogram at start: empty (NaN) until the first Allocate, never missing.")
        .unit("s")
    )
    churn = series(
        "Re-registrations and stream ends",
        8,
        "node, resource",
        (
            f"sum by (node, resource) (increase(rdma_dp_registrations_total{{{FLEET}}}[$__rate_interval]))",
            "registrations",
        ),
        (f"sum by (node, resource) (increase(rdma_dp_stream_ends_total{{{FLEET}}}[$__rate_interval]))", "stream ends"),
    )
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
            .multi(True)
            .sort(dm.VariableSort.ALPHABETICAL_ASC)
        )
        .with_row(fleet_row)
        .with_panel(fleet_ready)
        .with_panel(readiness)
        .with_panel(ports_down)
        .with_panel(capacity)
        .with_panel(allocations)
        .with_panel(latency)
        .with_panel(churn)
        .with_row(node_row)
        .with_panel(port_states)
        .with_panel(nics)
        .with_panel(devices)
        .with_panel(registered)
        .with_panel(loops)
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
