"""The plugin's config file (``version: v1``): the one schema and the one place for defaults.

Parsed and validated up front; any problem becomes a single ``ConfigError`` whose
message names every bad key and how to fix it, before anything is served. The Helm
chart renders this file into its ConfigMap and its tests feed it back through
``load_config_text``; ``rdma-device-plugin config-schema`` prints the JSON schema.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rdma_node.selectors import MELLANOX_VENDOR

from . import sockets
from .config_base import (  # noqa: F401  (re-exported: readers of the schema import them from here)
    AF_INET,
    AF_INET6,
    LOCAL_SUFFIX,
    NUMA_SUFFIX,
    ConfigError,
    local_resource_name,
    numa_resource_name,
)
from .kubeletapi import MAX_MESSAGE_BYTES

CONFIG_VERSION = "v1"
DEFAULT_RESOURCE = "rdma/hca"
DEFAULT_SHARED_DEVICES = 1000
MAX_SHARED_DEVICES = 100_000

_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_HEX_ID = re.compile(r"^(0x)?[0-9a-fA-F]{4}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RELEASE = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)([-+][0-9A-Za-z.+-]*)?$")
_CDI_KIND = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-zA-Z0-9]([-a-zA-Z0-9_.]*[a-zA-Z0-9])?$")
# Vendor domains whose CDI kinds other plugins and runtimes write (GPU and NIC vendors, Kubernetes,
# the runtimes): a spec file is named after its kind, so one of theirs would be replaced by ours,
# and a runtime would resolve their devices to our NICs. Subdomains count too.
FOREIGN_CDI_VENDORS = (
    "nvidia.com",
    "mellanox.com",
    "amd.com",
    "intel.com",
    "habana.ai",
    "xilinx.com",
    "google.com",
    "amazonaws.com",
    "microsoft.com",
    "k8s.io",
    "kubernetes.io",
    "openshift.io",
    "containerd.io",
    "cri-o.io",
)


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would reject ``name`` as an extended resource name, or None."""
    if name.count("/") != 1:
        return "must be <domain>/<name> with exactly one '/', e.g. rdma/hca"
    prefix, short = name.split("/")
    if "kubernetes.io/" in name or prefix.endswith("kubernetes.io"):
        return "must not use the kubernetes.io domain"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return f"domain {prefix!r} must be a lowercase DNS-1123 subdomain, e.g. rdma"
    if len(short) > 63 or not _QUALIFIED_NAME.fullmatch(short):
        return f"name {short!r} must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric"
    return None


_WORST_NUMA = 1023  # the kernel's MAX_NUMNODES is at most 1 << 10: the longest name numaPools can make


def _varint_len(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def worst_case_snapshot_bytes(resource_name: str, count: int) -> int:
    """Wire size of a shared pool's ListAndWatch message with every device Unhealthy (the longest
    health string): per device, field 1 {ID: 1 = "<name>-<i>", health: 2 = "Unhealthy"}."""
    short = resource_name.split("/", 1)[-1]
    total = 0
    for digits in range(1, len(str(max(count - 1, 0))) + 1):
        lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), min(count, 10**digits)
        if hi <= lo:
            continue
        id_len = len(short) + 1 + digits
        device = 1 + _varint_len(id_len) + id_len + 1 + 1 + len("Unhealthy")
        total += (hi - lo) * (1 + _varint_len(device) + device)
    return total


def largest_fitting_count(resource_name: str) -> int:
    lo, hi = 0, MAX_SHARED_DEVICES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if worst_case_snapshot_bytes(resource_name, mid) <= MAX_MESSAGE_BYTES:
            lo = mid
        else:
            hi = mid - 1
    return lo


def socket_path_problems(config: PluginConfig, device_plugin_dir: str) -> list[str]:
    """Socket paths the kernel cannot bind under ``device_plugin_dir``."""
    out = []
    for r in config.resources:
        for name in [r.name, *_derived_names(r)]:
            problem = sockets.path_problem(device_plugin_dir, name)
            if problem:
                out.append(f"resources[{r.name}]: {problem}")
    return out


def _derived_names(r: ResourceConfig) -> list[str]:
    """The longest names numaPools makes for ``r`` (none without it)."""
    if not r.numa_pools:
        return []
    return [numa_resource_name(r.name, _WORST_NUMA), local_resource_name(r.name)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, strict=True)


class SelectorsConfig(_Strict):
    """Which NICs a resource uses. Non-empty fields must all match; values within a field are alternatives."""

    vendors: list[str] = Field(default_factory=lambda: [MELLANOX_VENDOR], description="PCI vendor IDs, e.g. 15b3.")
    device_ids: list[str] = Field(default_factory=list, alias="deviceIDs", description="PCI device IDs, e.g. 1021.")
    drivers: list[str] = Field(default_factory=list, description="Kernel drivers of the PCI function, e.g. mlx5_core.")
    if_names: list[str] = Field(default_factory=list, alias="ifNames", description="Netdev names (ports or bonds).")
    rdma_devices: list[str] = Field(
        default_factory=list, alias="rdmaDevices", description="RDMA device names, e.g. mlx5_bond_0."
    )
    link_types: list[Literal["Ethernet", "InfiniBand"]] = Field(
        default_factory=list, alias="linkTypes", description="Port link layers: Ethernet (RoCE) or InfiniBand."
    )

    @field_validator("vendors", "device_ids")
    @classmethod
    def _hex_ids(cls, values: list[str]) -> list[str]:
        for v in values:
            if not _HEX_ID.fullmatch(v):
                raise ValueError(f"{v!r} is not a 4-digit hex PCI ID (write it like 15b3 or 0x15b3)")
        return [v.lower().removeprefix("0x") for v in values]


class ResourceConfig(_Strict):
    """One extended resource (one resource pool) the plugin advertises."""

    name: str = Field(DEFAULT_RESOURCE, description="Extended resource name, <domain>/<name>.")
    shared_devices: int = Field(
        DEFAULT_SHARED_DEVICES,
        alias="sharedDevices",
        ge=1,
        le=MAX_SHARED_DEVICES,
        description="Shared mode: virtual devices advertised for the pool.",
    )
    selectors: SelectorsConfig = Field(default_factory=SelectorsConfig)
    numa_pools: bool = Field(
        False,
        alias="numaPools",
        description="Shared mode: also advertise <name>-numa<N> per NUMA node (that node's NICs, its TopologyInfo) "
        "and <name>-local (the NICs of the NUMA node the Topology Manager aligns with the pod's GPUs).",
    )

    @field_validator("name")
    @classmethod
    def _resource_name(cls, value: str) -> str:
        problem = resource_name_problem(value)
        if problem:
            raise ValueError(f"invalid resource name {value!r}: {problem}")
        return value


REUSE_PENALTY = 0.75  # health.REUSE: a hold-down ends there (RFC 2439's 750 for 1000 a flap)


class FlapDampingConfig(_Strict):
    """Route-flap damping of NIC health (RFC 2439; health.py): a NIC is Unhealthy at once, and
    Healthy again after a hold-down that grows with how often it flapped."""

    enabled: bool = Field(True, description="Hold a flapping NIC down (off: every port change reaches the kubelet).")
    half_life_seconds: float = Field(
        15.0,
        alias="halfLifeSeconds",
        gt=0,
        le=3600,
        description="A NIC's flap penalty halves this often; a flap adds 1.",
    )
    suppress_penalty: float = Field(
        1.5,
        alias="suppressPenalty",
        gt=REUSE_PENALTY,
        le=100,
        description="Penalty at which a NIC is held down (each flap adds 1, halving every halfLifeSeconds; 1.5: a "
        "second flap within one half-life): Unhealthy even while up, until the penalty has decayed to 0.75.",
    )
    max_hold_down_seconds: float = Field(
        120.0,
        alias="maxHoldDownSeconds",
        gt=0,
        le=86400,
        description="The longest hold-down, however often the NIC flapped (the penalty is capped there).",
    )


class HealthConfig(_Strict):
    interval_seconds: float = Field(
        0.1,
        alias="intervalSeconds",
        gt=0,
        le=60,
        description="How often port states are probed while link events do not cover every selected port.",
    )
    link_events: bool = Field(
        True,
        alias="linkEvents",
        description="Re-read port states at once on a link notification (rtnetlink) for a selected NIC's netdev; "
        "seen only where the netdevs are in the plugin's network namespace (hostNetwork).",
    )
    link_events_interval_seconds: float = Field(
        1.0,
        alias="linkEventsIntervalSeconds",
        gt=0,
        le=60,
        description="How often port states are still polled while link events cover every selected port "
        "(a lost notification is caught within this).",
    )
    policy: Literal["all", "any"] = Field(
        "all",
        description="Shared pool is Healthy when all (default) or any of its NICs are usable (every port ACTIVE, "
        "not held down); a pod always gets every present NIC of the pool (docs/configuration.md).",
    )
    flap_damping: FlapDampingConfig = Field(default_factory=FlapDampingConfig, alias="flapDamping")
    vanish_grace_seconds: float = Field(
        300.0,
        alias="vanishGraceSeconds",
        ge=0,
        le=86400,
        description="A selected NIC gone this long leaves its pool (until then it counts as Unhealthy).",
    )


class CharDevicesConfig(_Strict):
    umad: bool = Field(False, description="Also hand out /dev/infiniband/umad* (management datagrams).")
    issm: bool = Field(False, description="Also hand out /dev/infiniband/issm* (subnet management).")


class NonHostNetworkConfig(_Strict):
    enabled: bool = Field(
        False, description="Pods keep their own netns; requires IPv6 compute network and shared netns mode."
    )
    checks: Literal["enforce", "warn"] = Field(
        "enforce", description="enforce: a failed start check stops the plugin; warn: log and serve."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Extra env added to every allocation when enabled (e.g. NCCL_SOCKET_FAMILY)."
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)


class CdiConfig(_Strict):
    enabled: bool = Field(False, description="Write a CDI spec and answer Allocate with CDI device names.")
    kind: str = Field("rdma.lingjun.io/hca", description="CDI kind, <vendor>/<class>.")

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if not _CDI_KIND.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a CDI kind; write it as <vendor domain>/<class>, e.g. rdma.lingjun.io/hca"
            )
        vendor = value.split("/", 1)[0]
        foreign = next((d for d in FOREIGN_CDI_VENDORS if vendor == d or vendor.endswith("." + d)), None)
        if foreign is not None:
            raise ValueError(
                f"{value!r} names a CDI kind of another vendor ({foreign}): its spec file would be replaced by this"
                " plugin's and its devices resolved to RDMA NICs; use a domain of your own, e.g. rdma.lingjun.io/hca"
            )
        return value


class WorkloadEnvConfig(_Strict):
    """The env NCCL and UCX read, computed from the NICs each container was allocated (docs/nccl.md)."""

    enabled: bool = Field(
        True,
        description="Set NCCL_IB_HCA, the GID choice (NCCL_IB_GID_INDEX, or NCCL_IB_ADDR_FAMILY/"
        "NCCL_IB_ROCE_VERSION_NUM/NCCL_IB_ADDR_RANGE) and UCX_NET_DEVICES from the allocated NICs.",
    )
    addr_family: Literal["auto", "AF_INET", "AF_INET6"] = Field(
        "auto",
        alias="addrFamily",
        description="Address family of the RoCE GID NCCL uses. auto: AF_INET6 with nonHostNetwork (or an IPv6 "
        "addrRange); else AF_INET where every allocated RoCE NIC has an IPv4 RoCE v2 GID, AF_INET6 where not.",
    )
    addr_range: str = Field(
        "",
        alias="addrRange",
        description="CIDR the GID's address must be in (NCCL_IB_ADDR_RANGE), e.g. the pods' IPv6 compute prefix; "
        "empty: any.",
    )
    roce_version: Literal[1, 2] = Field(
        2, alias="roceVersion", description="RoCE version of the GID NCCL uses (NCCL_IB_ROCE_VERSION_NUM)."
    )
    ucx: bool = Field(True, description="Also set UCX_NET_DEVICES (<device>:<port> of every allocated port).")

    @field_validator("addr_range")
    @classmethod
    def _cidr(cls, value: str) -> str:
        if not value:
            return value
        if "/" not in value:
            # NCCL ignores a range without a prefix length (envIbAddrRange)
            raise ValueError(f"{value!r} has no prefix length; write it as <address>/<bits>, e.g. 2408:4005:300::/56")
        try:
            return str(ipaddress.ip_network(value, strict=False))
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a CIDR ({exc}); write e.g. 10.0.0.0/8 or 2408:4005:300::/56") from None

    @model_validator(mode="after")
    def _range_in_family(self) -> WorkloadEnvConfig:
        given = self.range_family
        if given is not None and self.addr_family not in ("auto", given):
            raise ValueError(
                f"addrRange {self.addr_range} is an {given} range but addrFamily is {self.addr_family} "
                "(NCCL ignores a range of the other family): make them agree"
            )
        return self

    @property
    def range_family(self) -> str | None:
        if not self.addr_range:
            return None
        return AF_INET if ipaddress.ip_network(self.addr_range).version == 4 else AF_INET6


def _check_env(value: dict[str, str]) -> dict[str, str]:
    for name in value:
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a valid environment variable name")
    return value


class PluginConfig(_Strict):
    """Top level of the config file."""

    version: Literal["v1"] = Field("v1", description="Config format version.")
    plugin_version: str | None = Field(
        None,
        alias="pluginVersion",
        pattern=_RELEASE.pattern,
        description="The plugin version this config was written for (the chart writes its appVersion). A plugin "
        "of an older major.minor refuses the config and says so, rather than failing on keys it does not know.",
    )
    mode: Literal["shared", "exclusive"] = Field(
        "shared", description="shared: every pool is N virtual devices; exclusive: one device per NIC."
    )
    resources: list[ResourceConfig] = Field(default_factory=lambda: [ResourceConfig()], min_length=1)
    health: HealthConfig = Field(default_factory=HealthConfig)
    rediscovery_interval_seconds: float = Field(
        60.0,
        alias="rediscoveryIntervalSeconds",
        gt=0,
        le=3600,
        # Hot-plug, removal and port states are noticed at every probe; the timer only catches
        # attribute changes of a NIC that stays (netdevs, GIDs). A re-list reads ~30 files per NIC:
        # at 5 s it was a third of the idle CPU (issue 15).
        description="How often NICs are fully re-listed (netdev or GID changes of a NIC that stays).",
    )
    char_devices: CharDevicesConfig = Field(default_factory=CharDevicesConfig, alias="charDevices")
    env: dict[str, str] = Field(default_factory=dict, description="Extra env added to every allocation.")
    non_host_network: NonHostNetworkConfig = Field(default_factory=NonHostNetworkConfig, alias="nonHostNetwork")
    cdi: CdiConfig = Field(default_factory=CdiConfig)
    workload_env: WorkloadEnvConfig = Field(default_factory=WorkloadEnvConfig, alias="workloadEnv")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_env(value)

    @field_validator("resources")
    @classmethod
    def _numa_pools_shared_only(cls, value: list[ResourceConfig], info: ValidationInfo) -> list[ResourceConfig]:
        if info.data.get("mode") == "exclusive":
            bad = [r.name for r in value if r.numa_pools]
            if bad:
                raise ValueError(
                    f"numaPools of {bad} applies to shared mode only; exclusive mode already gives every NIC its "
                    "own device with its NUMA node: remove numaPools or use mode: shared"
                )
        return value

    @field_validator("resources")
    @classmethod
    def _unique_names(cls, value: list[ResourceConfig]) -> list[ResourceConfig]:
        names = [r.name for r in value]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate resource name(s) {dupes}: give every resource its own name")
        for r in value:
            for derived in _derived_names(r):
                problem = resource_name_problem(derived)
                if problem:
                    raise ValueError(
                        f"resource {r.name}: numaPools makes names like {derived}, which {problem}: shorten the name"
                    )
            # compared by socket base name: rdma/hca.local would serve rdma/hca-local's sockets
            numa_base = re.compile(re.escape(sockets.base_name(r.name) + NUMA_SUFFIX) + r"[0-9]+")
            local_base = sockets.base_name(local_resource_name(r.name))
            bases = {n: sockets.base_name(n) for n in names if n != r.name}
            clash = [n for n, b in bases.items() if r.numa_pools and (numa_base.fullmatch(b) or b == local_base)]
            if clash:
                raise ValueError(
                    f"resource name(s) {clash} are (or share a socket name with) names numaPools of {r.name} makes: "
                    "rename them or turn numaPools off"
                )
        by_socket: dict[str, list[str]] = {}
        for n in names:
            by_socket.setdefault(sockets.base_name(n), []).append(n)
        for sock, owners in sorted(by_socket.items()):
            if len(owners) > 1:
                raise ValueError(
                    f"resource names {owners} map to the same socket file name {sock} ('/' and '.' are replaced): "
                    "rename one of them"
                )
        for r in value:
            if worst_case_snapshot_bytes(r.name, r.shared_devices) > MAX_MESSAGE_BYTES:
                raise ValueError(
                    f"resource {r.name}: sharedDevices {r.shared_devices} makes a ListAndWatch message of "
                    f"{worst_case_snapshot_bytes(r.name, r.shared_devices)} bytes, over the kubelet's 4 MiB limit; "
                    f"at most {largest_fitting_count(r.name)} fit with this name"
                )
        return value


# --------------------------------------------------------------------------- loading

_FIXES = {
    "extra_forbidden": "remove it or check its spelling",
    "literal_error": "use one of the allowed values",
    "missing": "add it",
    "int_type": "write a whole number",
    "float_type": "write a number",
    "bool_type": "write true or false",
    "string_type": "write a string",
    "list_type": "write a list",
    "dict_type": "write a mapping",
    "model_type": "write a mapping",
    "greater_than_equal": "raise it",
    "greater_than": "raise it",
    "less_than_equal": "lower it",
    "too_short": "add at least one entry",
}


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _format(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        msg = err["msg"].removeprefix("Value error, ")
        fix = _FIXES.get(err["type"])
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"  - {_loc(err['loc'])}: {msg}" + (f" ({fix})" if fix else ""))
    return f"invalid config {source}:\n" + "\n".join(lines)


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a release version such as 0.2.0; None for anything else (a source tree's
    0.0.0+unknown counts as unknown too). Patch releases never change the config, so they do not count."""
    m = _RELEASE.match(version)
    if m is None or "+unknown" in version:
        return None
    return int(m[1]), int(m[2])


def _own_version() -> str:
    from . import __version__

    return str(__version__)


def newer_config_problem(written_for: object, running: str, source: str) -> str | None:
    """Why a config written for a newer plugin (``pluginVersion``) cannot run here, or None."""
    wanted = release(written_for) if isinstance(written_for, str) else None
    have = release(running)
    if wanted is None or have is None or wanted <= have:
        return None
    return (
        f"config {source} was written for rdma-device-plugin {written_for} (pluginVersion, the chart's appVersion) "
        f"but this plugin is {running}: the image is older than the chart that wrote the config. Run the image the "
        f"chart names (image.tag empty = its appVersion; pin image.digest, or pullPolicy Always where a tag was "
        f"pushed again with other content), or install the chart release whose appVersion is {running}"
    )


def load_config_data(data: Any, source: str = "<data>", running: str | None = None) -> PluginConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: the top level must be a mapping with version: v1")
    if "pluginVersion" in data:  # before the keys: a newer config's new keys would only say "unknown key"
        problem = newer_config_problem(data["pluginVersion"], running or _own_version(), source)
        if problem:
            raise ConfigError(problem)
    try:
        return PluginConfig.model_validate(data, by_alias=True)
    except ValidationError as exc:
        raise ConfigError(_format(exc, source)) from None


def load_config_text(text: str, source: str = "<text>") -> PluginConfig:
    import yaml  # only when there is a file to read (the built-in defaults need no YAML)

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid config {source}: not valid YAML: {exc}") from None
    except (ValueError, AttributeError, TypeError, LookupError, RecursionError) as exc:
        # PyYAML's constructors raise these for values such as "2001-13-45" or "!!timestamp x",
        # and its composer recurses on deep nesting.
        raise ConfigError(
            f"invalid config {source}: a YAML value cannot be read ({type(exc).__name__}: {exc}); "
            "quote dates and tagged values, and avoid deep nesting"
        ) from None
    return load_config_data(data, source)


def load_config(path: str | None) -> PluginConfig:
    """Load and validate a config file; None means the built-in defaults."""
    if path is None:
        return PluginConfig()
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}; check --config") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"invalid config {path}: not UTF-8 text (byte {exc.start}: {exc.reason}); write the file as UTF-8 YAML"
        ) from None
    return load_config_text(text, path)


def config_json_schema() -> dict[str, Any]:
    return PluginConfig.model_json_schema(by_alias=True)
