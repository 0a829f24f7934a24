"""The example inventory is a user's first real run: every stage that can run without its hosts
(argument specs of every role, the image role's inventory checks and tags, the chart values
templated and validated against the chart's schema, the chart rendered by the real Helm engine)
passes on it, and the deploy never pretends to have installed something it did not."""

from __future__ import annotations

from pathlib import Path

import yaml
from conftest import run_playbook

EXAMPLE = "inventories/lingjun-example"
# The stages of site.yml that need no host: the image stage without reading or pushing to the
# registry, the deploy stage rendering only. Validate/verify still run their argument specs.
OFFLINE = ["--tags", "image,deploy", "--skip-tags", "plugin_image_registry,plugin_image_build"]


def _ok(result) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_site_check_passes_on_the_example_inventory() -> None:
    # The default callback: this repository's one hides argument checks that pass.
    result = run_playbook(
        "playbooks/site.yml", "-i", EXAMPLE, "--check", *OFFLINE, "-e", "plugin_deploy_render_only=true",
        ANSIBLE_STDOUT_CALLBACK="default",
    )  # fmt: skip
    _ok(result)
    out = result.stdout
    # every stage's roles' argument specs were checked against every host's values once, on the
    # controller, before anything else (tests/test_inventory_errors.py shows it refusing bad ones)
    assert out.index("Check every host's typed values against every stage's roles") < out.index("PLAY [Build")
    assert "registry.example.com/rdma/rdma-device-plugin:" in out
    # --check names the values file it would write and shows it, instead of pointing at a missing file
    assert "--check: would write " in out and "sharedDevices: 1000" in out
    assert out.count("sharedDevices: 1000") == 1  # once: without --diff the debug shows it, with --diff the diff does
    flat = " ".join(out.split())
    # serviceaccount, configmap, daemonset, admission-policy, tenant-policy and the helm test
    assert "--check: the chart renders 6 manifests of release rdma" in flat, flat[-3000:]
    assert "nothing was written or installed (without --check they go to" in flat
    assert "apply them with" not in flat  # no folder it did not write is pointed at
    assert "placeholder registry.example.com/rdma/rdma-device-plugin, which nobody publishes" in flat


def test_render_only_writes_the_manifests_with_typed_command_line_values(tmp_path: Path) -> None:
    """-e values arrive as strings: the rendered chart still gets a boolean and an integer."""
    manifests, values_dir = tmp_path / "manifests", tmp_path / "values"
    result = run_playbook(
        "playbooks/site.yml", "-i", EXAMPLE, *OFFLINE,
        "-e", "plugin_deploy_render_only=yes",
        "-e", f"plugin_deploy_manifests_dir={manifests}", "-e", f"plugin_deploy_values_dir={values_dir}",
        "-e", "rdma_non_host_network=true", "-e", "rdma_shared_devices=500",
        "-e", "rdma_metrics_enabled=on", "-e", "rdma_metrics_port=9411", "-e", "rdma_admission_policy_enabled=no",
    )  # fmt: skip
    _ok(result)
    values = yaml.safe_load((values_dir / "rdma-values.yaml").read_text())
    assert values["nonHostNetwork"]["enabled"] is True
    assert values["sharedDevices"] == 500
    assert values["metrics"] == {"enabled": True, "port": 9411}
    assert values["admissionPolicy"]["enabled"] is False
    docs = [d for f in sorted(manifests.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"DaemonSet", "ConfigMap"} <= kinds, kinds
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    assert "500" in yaml.safe_dump(config["data"])
    assert "Nothing was installed (plugin_deploy_render_only)" in result.stdout


def test_deploy_without_helm_fails_and_says_what_to_install(tmp_path: Path) -> None:
    result = run_playbook(
        "playbooks/site.yml", "-i", EXAMPLE, *OFFLINE,
        "-e", "plugin_deploy_helm_binary=/nonexistent/helm", "-e", f"plugin_deploy_values_dir={tmp_path}",
        "-e", "plugin_image_registry=registry.mycorp.example",  # not the placeholder (refused before helm)
    )  # fmt: skip
    assert result.returncode != 0
    assert "Install Helm 3.8 or later" in result.stdout
    assert "-e plugin_deploy_render_only=true" in result.stdout


def test_the_placeholder_registry_is_refused_before_anything_is_installed(tmp_path: Path) -> None:
    """The example's registry.example.com publishes nothing: a real deploy (not render only) stops at
    once, saying how to build and push the image or which variable names a pushed one."""
    result = run_playbook(
        "playbooks/site.yml", "-i", EXAMPLE, *OFFLINE, "-e", f"plugin_deploy_values_dir={tmp_path}",
    )  # fmt: skip
    out = " ".join(result.stdout.split())
    assert result.returncode == 2, out[-3000:]
    assert "from registry.example.com, the example's placeholder" in out, out[-3000:]
    assert "-e plugin_image_enabled=true -e plugin_image_registry=" in out and "rdma_plugin_image_repository" in out
    assert "Nothing was installed" in out and "Install Helm" not in out  # refused before helm is looked for


def test_bad_typed_value_names_the_variable() -> None:
    result = run_playbook("playbooks/site.yml", "-i", EXAMPLE, "--check", *OFFLINE,
                          "-e", "plugin_deploy_render_only=true", "-e", "rdma_shared_devices=lots")  # fmt: skip
    assert result.returncode != 0
    assert "rdma_shared_devices" in result.stdout + result.stderr
