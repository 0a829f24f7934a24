"""The DRA driver: the same NICs as the device plugin, through Dynamic Resource Allocation.

``rdma-device-plugin dra`` publishes each node's NICs as ResourceSlices (:mod:`.model`,
:mod:`.publisher`), serves the kubelet's DRA gRPC (:mod:`.service`) and prepares claims with one CDI
spec each (:mod:`.claims`), reusing the device plugin's discovery, health rule, pools and NCCL env.
The kubelet-plugin plumbing (per-instance sockets, the prepare lock, which instance publishes) is
:mod:`.kubeletplugin`; metrics :mod:`.metrics`.
docs/dra.md is the operator's guide, docs/design.md explains the device model.
"""
