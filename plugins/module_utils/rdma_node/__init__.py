"""Reading a node (RDMA NICs, IPv6, PCIe tree, netdevs and bonds, node health), the checks over
what was read, and writing kernel-shaped fixture nodes.

Standard library only: the Ansible roles ship this package to nodes as module_utils.
"""
