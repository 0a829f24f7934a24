#!/usr/bin/env python3
"""A real Prometheus (Debian's ``prometheus``) on 127.0.0.1 with the chart's alert rules, scraping
RDMA device plugins: used by the chart tests (tests/test_prometheus.py) and by
``make prometheus-local``, which points it at the local default's plugin and prints the alert
states and the address where the dashboard's queries can be tried.

Standard library only. Every server gets its own temp data dir and a free port.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """``prometheus`` scraping ``targets`` (host:port) as ``job`` with ``labels`` every ``interval``
    (``scrape``: more of that job's scrape config, e.g. scheme, tls_config, authorization)."""

    def __init__(
        self,
        job: str,
        targets: list[str],
        labels: dict[str, str],
        rule_groups: list[dict[str, Any]],
        interval: str = "1s",
        port: int = 0,
        workdir: str | None = None,
        extra_scrape_configs: list[dict[str, Any]] | None = None,
        scrape: dict[str, Any] | None = None,
    ) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed: make system-deps (Debian package prometheus)")
        self.dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="rdp-prom-", dir="/tmp"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._own_dir = workdir is None
        (self.dir / "rules.json").write_text(json.dumps({"groups": rule_groups}), encoding="utf-8")
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
            "rule_files": [str(self.dir / "rules.json")],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets, "labels": labels}], **(scrape or {})},
                *(extra_scrape_configs or []),
            ],
        }
        (self.dir / "prometheus.json").write_text(json.dumps(config), encoding="utf-8")
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = open(self.dir / "prometheus.log", "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        # YAML is a superset of JSON: prometheus reads the JSON files as its YAML config and rules.
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={self.dir / 'prometheus.json'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address={self.address}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return (self.dir / "prometheus.log").read_text(encoding="utf-8", errors="replace")

    def get(self, path: str, **params: str) -> Any:
        url = f"http://{self.address}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read().decode())

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready within {timeout} s:\n{self.output()[-3000:]}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        doc = self.get("/api/v1/query", query=expr)
        if doc.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {doc}")
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.get("/api/v1/alerts")["data"]["alerts"]
        return alerts

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.get("/api/v1/targets")["data"]["activeTargets"]
        return active

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def chart_rule_groups(values: dict[str, Any], release: str = "rdma", namespace: str = "kube-system") -> list[dict[str, Any]]:
    """The chart's PrometheusRule groups, rendered by the real Helm engine (helm_python)."""
    import helm_python
    import yaml
    from helm_python import _native

    chart = helm_python.Chart.load(str(ROOT / "charts" / "rdma-device-plugin"))
    # As `helm template --api-versions monitoring.coreos.com/v1`: Chart.render has no such option,
    # the SDK's native helm_render takes it (as the chart tests' conftest.render_raw does).
    opts = {"name": release, "namespace": namespace, "api_versions": ["monitoring.coreos.com/v1"]}
    rendered = json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values), json.dumps(opts)))
    for path, text in rendered.items():
        if path.endswith("prometheusrule.yaml"):
            for doc in yaml.safe_load_all(text):
                if doc and doc.get("kind") == "PrometheusRule":
                    groups: list[dict[str, Any]] = doc["spec"]["groups"]
                    return groups
    raise RuntimeError("the chart rendered no PrometheusRule")


def chart_for_keys() -> list[str]:
    """Every metrics.prometheusRule.for key of the chart's values.yaml (one per alert)."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "rdma-device-plugin" / "values.yaml").read_text(encoding="utf-8"))
    return list(values["metrics"]["prometheusRule"]["for"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", default="127.0.0.1:9410", help="the plugin's metrics address (local default)")
    parser.add_argument("--node", default="lingjun-node-0", help="node label of the target")
    parser.add_argument("--port", type=int, default=9090, help="Prometheus port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--workdir", default=str(ROOT / "out" / "local" / "prometheus"), help="config and data")
    parser.add_argument("--for", dest="for_", default="30s", help="for: of every alert (short, to see them fire)")
    parser.add_argument("--wait", type=float, default=15.0, help="seconds to scrape before printing the alerts")
    parser.add_argument("--keep", action="store_true", help="keep Prometheus running (Ctrl-C stops it)")
    args = parser.parse_args(argv)
    # The local default has no kube-state-metrics: the alerts that read it are left out, and the fleet
    # is the plugin targets.
    values = {
        "metrics": {
            "enabled": True,
            "prometheusRule": {
                "enabled": True,
                "for": dict.fromkeys(chart_for_keys(), args.for_),
                "kubeStateMetrics": {"enabled": False},
            },
        }
    }
    job = "rdma-rdma-device-plugin-metrics"
    try:
        with urllib.request.urlopen(f"http://{args.target}/metrics", timeout=5):
            pass
    except OSError as exc:
        print(
            f"no plugin metrics at {args.target} ({exc}); start the local default first: "
            "flock /tmp/molecule.lock make demo",
            file=sys.stderr,
        )
        return 2
    prom = Prometheus(job, [args.target], {"node": args.node}, chart_rule_groups(values), "5s", args.port, args.workdir)
    try:
        prom.wait_ready()
        print(f"Prometheus {prom.address} (http://{prom.address}/graph) scraping {args.target} as job {job}")
        time.sleep(args.wait)
        for t in prom.targets():
            print(f"target {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".rstrip())
        firing = {(a["labels"]["alertname"], json.dumps(a["labels"], sort_keys=True)): a["state"] for a in prom.alerts()}
        for group in chart_rule_groups(values):
            for rule in group["rules"]:
                states = [f"{state} {labels}" for (name, labels), state in firing.items() if name == rule["alert"]]
                print(f"alert {rule['alert']}: {'; '.join(states) if states else 'inactive'}")
        print(f"Try the dashboard's queries at http://{prom.address}/graph (job=\"{job}\", node=\"{args.node}\")")
        if args.keep:
            print("Prometheus keeps running; Ctrl-C stops it", flush=True)
            try:
                prom.proc.wait()
            except KeyboardInterrupt:
                pass
    finally:
        prom.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
