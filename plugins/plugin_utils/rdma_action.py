# Copyright: rdma-device-plugin maintainers; Apache-2.0
"""Shared by the lingjun.rdma action plugins that run the module of their own name."""

from __future__ import annotations


def execute_beside(action, default, args, task_vars):
    """Run the module beside ``action`` (``rdma_x``, or ``lingjun.rdma.rdma_x`` in the collection: the
    task's resolved name, else ``default``) once with ``args``, then remove the remote temporary directory
    as ansible-core's own ``normal`` action does. Returns the module's result."""
    try:
        module = action._task.resolved_action or default
        return action._execute_module(module_name=module, module_args=args, task_vars=task_vars)
    finally:
        action._remove_tmp_path(action._connection._shell.tmpdir)
