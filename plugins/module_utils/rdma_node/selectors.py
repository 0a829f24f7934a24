"""Which NICs a resource uses (standard library only; shared with the Ansible roles).

Every non-empty field must match (AND across fields, OR within a field); an empty field
matches everything. The default selects every Mellanox/NVIDIA (vendor 15b3) NIC.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .sysfs import Nic

MELLANOX_VENDOR = "15b3"
LINK_TYPES = ("Ethernet", "InfiniBand")


@dataclass(frozen=True)
class Selectors:
    vendors: tuple[str, ...] = (MELLANOX_VENDOR,)
    device_ids: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    if_names: tuple[str, ...] = ()
    rdma_devices: tuple[str, ...] = ()
    link_types: tuple[str, ...] = ()

    @classmethod
    def of(cls, fields: Any) -> Selectors:
        """From the config's validated selectors (a model, or its plain view in the DRA driver)."""
        return cls(
            vendors=tuple(fields.vendors),
            device_ids=tuple(fields.device_ids),
            drivers=tuple(fields.drivers),
            if_names=tuple(fields.if_names),
            rdma_devices=tuple(fields.rdma_devices),
            link_types=tuple(fields.link_types),
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Sequence[str]]) -> Selectors:
        """Build from the config's camelCase keys (vendors, deviceIDs, drivers, ifNames, rdmaDevices, linkTypes)."""
        keys = {
            "vendors": "vendors",
            "deviceIDs": "device_ids",
            "drivers": "drivers",
            "ifNames": "if_names",
            "rdmaDevices": "rdma_devices",
            "linkTypes": "link_types",
        }
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise ValueError(f"unknown selector key(s) {unknown}; allowed: {sorted(keys)}")
        for k, v in data.items():
            if isinstance(v, str) or (v is not None and not isinstance(v, Sequence)):
                # a string would select by its characters ("15b3" -> "1", "5", ...): no NIC at all
                raise ValueError(
                    f"selector {k} must be a list of strings, not {v!r}; write {k}: [{json.dumps(str(v))}]"
                )
        kwargs = {keys[k]: tuple(str(v) for v in data[k]) for k in data if data[k] is not None}
        return cls(**kwargs)

    def matches(self, nic: Nic) -> bool:
        def norm(values: Iterable[str]) -> set[str]:
            return {v.lower().removeprefix("0x") for v in values}

        if self.vendors and nic.vendor not in norm(self.vendors):
            return False
        if self.device_ids and nic.device_id not in norm(self.device_ids):
            return False
        if self.drivers and nic.driver not in self.drivers:
            return False
        if self.rdma_devices and nic.name not in self.rdma_devices:
            return False
        if self.if_names and not set(nic.netdevs) & set(self.if_names):
            return False
        if self.link_types and not set(nic.link_layers) & set(self.link_types):
            return False
        return True

    def select(self, nics: Iterable[Nic]) -> list[Nic]:
        return [n for n in nics if self.matches(n)]
