"""``python -m rdma_device_plugin``."""

from .cli import main

raise SystemExit(main())
