"""The one boundary for typed inventory variables: ``x | rdma_bool('name')``, ``x | rdma_int('name')``.

Extra vars (``-e rdma_non_host_network=true``) arrive as strings and outrank every other variable
source, so they cannot be normalised once with set_fact; every role reads its boolean and integer
variables through these filters instead. The accepted spellings are exactly those of the roles'
argument_specs validation, because both call the converters argument specs use
(ansible.module_utils.common.validation.check_type_bool / check_type_int): true/false, yes/no,
on/off, 1/0, y/n, t/f for booleans, decimal integers for integers. Anything else fails with one
message naming the variable and the fix, instead of Jinja's silent ``"abc" | int == 0``.
"""

from __future__ import annotations

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.validation import check_type_bool, check_type_int


def rdma_bool(value, name="value"):
    try:
        return check_type_bool(value)
    except TypeError:
        raise AnsibleFilterError(
            f"{name}={value!r} is not a boolean; use true or false (yes/no, on/off, 1/0 also work), "
            f"e.g. -e {name}=true"
        ) from None


def rdma_int(value, name="value"):
    # None passes through: optional integers (rdma_nic_validate_expected_nics: null) stay unset.
    if value is None:
        return None
    if isinstance(value, bool):  # check_type_int would take True as 1; YAML `true` is a mistake here
        raise AnsibleFilterError(f"{name}={value!r} is not an integer; give a whole number, e.g. -e {name}=4")
    try:
        return check_type_int(value.strip() if isinstance(value, str) else value)
    except TypeError:
        raise AnsibleFilterError(
            f"{name}={value!r} is not an integer; give a whole number, e.g. -e {name}=4"
        ) from None


class FilterModule:
    def filters(self):
        return {"rdma_bool": rdma_bool, "rdma_int": rdma_int}
