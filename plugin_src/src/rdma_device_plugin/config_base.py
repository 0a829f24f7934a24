"""What the config's readers need without its schema: the error, the derived names, the families.

:mod:`.config` (the one schema, pydantic) re-exports all of it. This module exists apart so that a
process which reads a validated config but never validates one (the DRA driver, :mod:`.config_view`)
does not load pydantic for a constant or an exception class.
"""

from __future__ import annotations

from collections.abc import Sequence


class ConfigError(ValueError):
    """The config cannot be used; the message says which key and how to fix it."""

    @classmethod
    def listing(cls, what: str, problems: Sequence[str]) -> ConfigError:
        """``invalid config <what>:`` and one indented line per problem."""
        return cls(f"invalid config {what}:\n" + "\n".join(f"  - {p}" for p in problems))


NUMA_SUFFIX = "-numa"  # rdma/hca -> rdma/hca-numa0, rdma/hca-numa1, ... (numaPools)
LOCAL_SUFFIX = "-local"  # rdma/hca -> rdma/hca-local (numaPools)

AF_INET, AF_INET6 = "AF_INET", "AF_INET6"


def numa_resource_name(name: str, numa_node: int) -> str:
    return f"{name}{NUMA_SUFFIX}{numa_node}"


def local_resource_name(name: str) -> str:
    return f"{name}{LOCAL_SUFFIX}"
