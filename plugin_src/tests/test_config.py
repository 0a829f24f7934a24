"""Config validation: defaults, and one clear message per bad key."""

from __future__ import annotations

import pytest

from rdma_device_plugin.config import ConfigError, load_config, load_config_text, resource_name_problem
from rdma_node.selectors import Selectors


def test_defaults_serve_rdma_hca_1000_over_mellanox() -> None:
    cfg = load_config(None)
    assert cfg.mode == "shared"
    assert [(r.name, r.shared_devices, r.selectors.vendors) for r in cfg.resources] == [("rdma/hca", 1000, ["15b3"])]
    assert cfg.health.policy == "all"
    assert cfg.health.interval_seconds <= 1.0


def test_full_config_round_trip() -> None:
    cfg = load_config_text(
        """
version: v1
mode: exclusive
resources:
  - name: rdma/hca
    sharedDevices: 500
    selectors: {vendors: ["0x15B3"], linkTypes: [Ethernet], ifNames: [bond0, bond1]}
  - name: example.com/ib
health: {intervalSeconds: 0.2, policy: any}
rediscoveryIntervalSeconds: 10
charDevices: {umad: true}
env: {NCCL_DEBUG: INFO}
"""
    )
    assert cfg.mode == "exclusive"
    assert cfg.resources[0].selectors.vendors == ["15b3"]
    assert Selectors.of(cfg.resources[0].selectors).if_names == ("bond0", "bond1")
    assert cfg.resources[1].shared_devices == 1000
    assert cfg.char_devices.umad and not cfg.char_devices.issm
    assert cfg.env == {"NCCL_DEBUG": "INFO"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mode: turbo", "mode: Input should be 'shared' or 'exclusive'"),
        ("version: v2", "version: Input should be 'v1'"),
        ("colour: blue", "colour: unknown key (remove it or check its spelling)"),
        ("resources:\n- name: Rdma/hca", "resources[0].name: invalid resource name 'Rdma/hca'"),
        ("resources:\n- name: hca", "exactly one '/'"),
        ("resources:\n- name: a/b/c", "exactly one '/'"),
        (
            "resources:\n- name: rdma/hca\n  sharedDevices: -5",
            "resources[0].sharedDevices: Input should be greater than or equal to 1",
        ),
        ("resources:\n- name: rdma/hca\n- name: rdma/hca", "duplicate resource name(s) ['rdma/hca']"),
        ("resources: []", "resources: List should have at least 1 item"),
        ("health: {intervalSeconds: -1}", "health.intervalSeconds: Input should be greater than 0"),
        ("health: {policy: most}", "health.policy: Input should be 'all' or 'any'"),
        ("resources:\n- selectors: {vendors: [mellanox]}", "is not a 4-digit hex PCI ID"),
        ("resources:\n- selectors: {linkTypes: [ether]}", "linkTypes[0]: Input should be 'Ethernet' or 'InfiniBand'"),
        ("env: {'1BAD': x}", "not a valid environment variable name"),
        ("sharedDevices: 5", "sharedDevices: unknown key"),
        ("- just a list", "the top level must be a mapping"),
        ("mode: [unclosed", "not valid YAML"),
    ],
)
def test_bad_config_names_key_and_fix(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text(text, "cfg.yaml")
    assert expected in str(err.value)
    assert "cfg.yaml" in str(err.value)


def test_all_problems_reported_together() -> None:
    with pytest.raises(ConfigError) as err:
        load_config_text("mode: x\nhealth: {policy: y}\nbogus: 1")
    msg = str(err.value)
    assert "mode:" in msg and "health.policy:" in msg and "bogus:" in msg


def test_unreadable_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yaml.*check --config"):
        load_config(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize("name", ["rdma/hca", "rdma.example.com/hca_1", "a/B"])
def test_valid_resource_names(name: str) -> None:
    assert resource_name_problem(name) is None


@pytest.mark.parametrize(
    "name", ["Rdma/hca", "hca", "a/b/c", "kubernetes.io/hca", "requests.x/y", "rdma/-x", "rdma/" + "x" * 64]
)
def test_invalid_resource_names(name: str) -> None:
    assert resource_name_problem(name) is not None


def test_resources_whose_socket_files_collide_are_refused() -> None:
    """rdma/hca.v2 and rdma/hca-v2 both map to rdma-dp-rdma_hca-v2.sock: each would restart the other."""
    with pytest.raises(ConfigError) as err:
        load_config_text("resources: [{name: rdma/hca.v2}, {name: rdma/hca-v2}]")
    assert "resources: resource names ['rdma/hca.v2', 'rdma/hca-v2'] map to the same socket file" in str(err.value)


@pytest.mark.parametrize("count", [1, 9, 10, 11, 99, 100, 1000, 12345])
def test_worst_case_snapshot_size_is_the_wire_size(count: int) -> None:
    """The arithmetic matches protobuf's own encoding of an all-Unhealthy shared pool."""
    from rdma_device_plugin.api import deviceplugin_pb2 as pb
    from rdma_device_plugin.config import worst_case_snapshot_bytes

    msg = pb.ListAndWatchResponse(devices=[pb.Device(ID=f"hca-{i}", health="Unhealthy") for i in range(count)])
    assert worst_case_snapshot_bytes("rdma/hca", count) == msg.ByteSize()


def test_a_pool_over_the_kubelets_4_mib_message_limit_is_refused_with_the_count_that_fits() -> None:
    from rdma_device_plugin.config import MAX_MESSAGE_BYTES, largest_fitting_count, worst_case_snapshot_bytes

    name = "rdma/" + "x" * 60
    fits = largest_fitting_count(name)
    assert worst_case_snapshot_bytes(name, fits) <= MAX_MESSAGE_BYTES < worst_case_snapshot_bytes(name, fits + 1)
    with pytest.raises(ConfigError) as err:
        load_config_text(f"resources: [{{name: {name}, sharedDevices: 100000}}]")
    assert f"over the kubelet's 4 MiB limit; at most {fits} fit with this name" in str(err.value)
    load_config_text(f"resources: [{{name: {name}, sharedDevices: {fits}}}]")
    load_config_text("resources: [{name: rdma/hca, sharedDevices: 100000}]")  # short names fit the maximum


def test_config_file_that_is_not_utf8_is_one_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "c.yaml"
    path.write_bytes(b"mode: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text .*write the file as UTF-8 YAML"):
        load_config(str(path))


@pytest.mark.parametrize(
    "kind", ["nvidia.com/gpu", "nvidia.com/rdma", "k8s.io/hca", "gpu.intel.com/i915", "NVIDIA.com/gpu"]
)
def test_cdi_kind_of_another_vendor_is_refused(kind: str) -> None:
    """Issue 39: the spec file is named after the kind, so nvidia.com/gpu would replace NVIDIA's spec
    and point its devices at our NICs. Refused, naming the key, the vendor and the fix."""
    with pytest.raises(ConfigError) as err:
        load_config_text(f"cdi: {{enabled: true, kind: {kind}}}")
    message = str(err.value)
    assert "cdi.kind" in message and "e.g. rdma.lingjun.io/hca" in message
    assert "another vendor" in message or "is not a CDI kind" in message  # upper case is no CDI vendor at all


@pytest.mark.parametrize("kind", ["rdma.lingjun.io/hca", "example.com/rdma", "rdma.example.org/hca", "notnvidia.com/x"])
def test_cdi_kind_of_your_own_domain_is_accepted(kind: str) -> None:
    assert load_config_text(f"cdi: {{enabled: true, kind: {kind}}}").cdi.kind == kind
