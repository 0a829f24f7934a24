"""The rendered DaemonSets start the plugin the way its own CLI understands, with every path mounted."""

from __future__ import annotations

import posixpath
from typing import Any

import pytest
from conftest import CASES, daemonsets

from rdma_device_plugin.cli import build_parser
from rdma_device_plugin.metrics import parse_address

PATH_FLAGS = ("config", "dev_root", "procfs_root", "device_plugin_dir", "cdi_dir")
# What the node reader opens under the sysfs root (class links resolve into devices/, driver
# links into bus/, module/ tells loaded modules and netns mode).
SYSFS_NEEDS = ("class/infiniband", "class/infiniband_verbs", "class/infiniband_mad", "class/net", "devices", "bus/pci", "module")


def _mount_for(path: str, mounts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The deepest volumeMount that contains ``path``."""
    best = None
    for m in mounts:
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (best is None or len(mp) > len(best["mountPath"])):
            best = m
    return best


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_args_parse_and_paths_are_mounted(case: str, mode: str) -> None:
    ds = daemonsets(CASES[case])[mode]
    pod = ds["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = build_parser().parse_args(container["args"])  # argparse exits on an unknown flag
    assert args.command == "serve"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = container["volumeMounts"]
    for sub in SYSFS_NEEDS:
        mount = _mount_for(f"{args.sysfs_root}/{sub}", mounts)
        assert mount is not None, f"{case}/{mode}: {args.sysfs_root}/{sub} is not mounted"
        volume = volumes[mount["name"]]
        assert mount.get("readOnly") is True and "hostPath" in volume
        # the mount maps the host's /sys subtree to the same place under the sysfs root
        rel = posixpath.relpath(mount["mountPath"], args.sysfs_root)
        assert volume["hostPath"]["path"].rstrip("/") == f"/sys/{rel}", f"{case}/{mode}: {sub}"
    for flag in PATH_FLAGS:
        path = getattr(args, flag)
        if flag == "cdi_dir" and "--cdi-dir" not in container["args"]:
            continue
        if flag == "dev_root" and path == "":
            continue  # char-device presence from sysfs: nothing to mount (see cli.py --dev-root)
        if flag == "procfs_root" and path == "/proc":
            # the container's own /proc/net is the node's only with hostNetwork, which the chart sets
            # exactly when the plugin reads it (the nonHostNetwork start checks)
            assert pod.get("hostNetwork", False) is CASES[case].get("nonHostNetwork", {}).get("enabled", False)
            continue
        mount = _mount_for(path, mounts)
        assert mount is not None, f"{case}/{mode}: --{flag.replace('_', '-')} {path} is not on any volumeMount"
        volume = volumes[mount["name"]]
        if flag == "config":
            assert "configMap" in volume and posixpath.dirname(path) == mount["mountPath"].rstrip("/")
        elif flag in ("device_plugin_dir", "cdi_dir"):
            # the plugin writes here: a host directory, mounted read-write
            assert "hostPath" in volume and not mount.get("readOnly", False), f"{case}/{mode}: {flag}"
        else:
            assert "hostPath" in volume and mount.get("readOnly") is True, f"{case}/{mode}: {flag} must be read-only"


# KubeletSocket (k8s.io/kubelet deviceplugin/v1beta1) is a constant: every kubelet serves kubelet.sock
# in /var/lib/kubelet/device-plugins, whatever its --root-dir (kubeletDir), as the real node shows.
@pytest.mark.parametrize(("case", "host"), [("defaults", "/var/lib/kubelet/device-plugins"),
                                            ("k3s", "/var/lib/kubelet/device-plugins")])
def test_device_plugin_dir_is_the_kubelets(case: str, host: str) -> None:
    pod = daemonsets(CASES[case])["shared"]["spec"]["template"]["spec"]
    args = build_parser().parse_args(pod["containers"][0]["args"])
    mount = _mount_for(args.device_plugin_dir, pod["containers"][0]["volumeMounts"])
    assert mount is not None
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["hostPath"]["path"].rstrip("/") == host


@pytest.mark.parametrize("pod_ip,host", [("10.0.3.7", "10.0.3.7"), ("fd00:10::7", "fd00:10::7")])
def test_metrics_address_parses_for_either_ip_family(pod_ip: str, host: str) -> None:
    """Kubernetes expands $(POD_IP) from the env; the plugin must accept the result for IPv4 and IPv6."""
    container = daemonsets(CASES["metrics"])["shared"]["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])
    assert any(e["name"] == "POD_IP" for e in container["env"])
    assert parse_address(args.metrics_address.replace("$(POD_IP)", pod_ip)) == (host, 9500)


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_liveness_probe_runs_the_plugins_healthcheck_on_the_file_serve_writes(mode: str) -> None:
    """The probe is the plugin's own `healthcheck`; serve and it agree on the health file
    (a tmpfs path, writable under readOnlyRootFilesystem)."""
    ds = daemonsets(CASES[sorted(CASES)[0]])[mode]
    container = ds["spec"]["template"]["spec"]["containers"][0]
    command = container["livenessProbe"]["exec"]["command"]
    assert command[0] == "rdma-device-plugin"
    probe = build_parser().parse_args(command[1:])
    serve = build_parser().parse_args(container["args"])
    assert probe.command == "healthcheck" and probe.health_file == serve.health_file
    assert serve.health_file.startswith("/dev/shm/")


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_readiness_probe_is_registered_with_the_kubelet_and_min_ready_seconds_hold_a_bad_rollout(mode: str) -> None:
    """Issue 31: a pod is Ready only when `healthcheck --ready` passes (every resource registered, the
    kubelet's stream open: plugin_src/tests/test_readiness.py), on the file serve writes, and the
    DaemonSet counts it available only after minReadySeconds: a plugin that never registers never
    becomes available, so the rolling update stops at its first maxUnavailable batch."""
    ds = daemonsets({})[mode]
    assert ds["spec"]["minReadySeconds"] == 30
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "10%"
    container = ds["spec"]["template"]["spec"]["containers"][0]
    probe = container["readinessProbe"]
    assert probe["exec"]["command"][0] == "rdma-device-plugin"
    ready = build_parser().parse_args(probe["exec"]["command"][1:])
    serve = build_parser().parse_args(container["args"])
    assert ready.command == "healthcheck" and ready.ready and ready.health_file == serve.health_file
    live = build_parser().parse_args(container["livenessProbe"]["exec"]["command"][1:])
    assert not live.ready  # liveness leaves an unregistered plugin running (it may be waiting for the kubelet)
    # it is checked often enough to turn Ready within seconds of the registration
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 30 and probe["successThreshold"] == 1
    assert daemonsets({"minReadySeconds": 90})[mode]["spec"]["minReadySeconds"] == 90
