"""Kubernetes device plugin for RDMA NICs on Lingjun-style GPU nodes."""

from typing import Any


def __getattr__(name: str) -> Any:
    # importlib.metadata costs about 6 MiB of RSS: read the version only when asked for it.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rdma-device-plugin")
        except PackageNotFoundError:  # running from a source tree without installation
            return "0.0.0+unknown"
    raise AttributeError(name)
