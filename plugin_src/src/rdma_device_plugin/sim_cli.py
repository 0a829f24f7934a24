"""Compatibility entry point: ``python -m rdma_device_plugin.sim_cli`` (the Ansible local target uses it).

The simulator lives in :mod:`rdma_device_plugin.kubesim`; ``serve`` never imports either.
"""

from .kubesim.sim_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
