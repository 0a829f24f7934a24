"""Kubernetes device plugin for RDMA NICs on Lingjun-style GPU nodes."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rdma-device-plugin")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"
