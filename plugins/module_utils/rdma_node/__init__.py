"""Reading a node (RDMA NICs, IPv6, PCIe tree, netdevs and bonds, node health), the checks over
what was read, and writing kernel-shaped fixture nodes.

Standard library only: the Ansible roles ship this package to nodes as module_utils.
"""

import sys as _sys

# Shipped by Ansible (AnsiballZ, a zip): keep the compiled code on the node (see _bytecode).
if type(_sys.modules[__name__].__loader__).__name__ == "zipimporter":
    from . import _bytecode

    _bytecode.install(_sys.modules[__name__])
