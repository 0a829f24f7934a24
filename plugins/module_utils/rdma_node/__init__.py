"""Reading a node's RDMA NICs and IPv6 state, and writing kernel-shaped fixture nodes.

Standard library only: the Ansible roles ship this package to nodes as module_utils.
"""
