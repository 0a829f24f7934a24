"""The metrics servers' auth flags, for ``serve`` and ``dra`` (standard library only: building the CLI
parser imports this, before ``serve`` keeps OpenSSL out; :mod:`.metricsauth` does the work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

MODES = ("none", "kubernetes")


def add_arguments(p: argparse.ArgumentParser, env: Callable[[str, str], str]) -> None:
    """The flags of both servers (``env(name, default)``: the sub-command's environment variable)."""
    p.add_argument(
        "--metrics-auth",
        choices=MODES,
        default=env("METRICS_AUTH", "none"),
        help="kubernetes: every scrape needs a bearer token that a TokenReview authenticates and a "
        "SubjectAccessReview allows to get /metrics (needs --metrics-tls-cert/-key); none: anyone who "
        "reaches the port reads the metrics (default; the chart turns auth on)",
    )
    p.add_argument("--metrics-tls-cert", default=env("METRICS_TLS_CERT", ""), help="serve metrics over HTTPS: cert")
    p.add_argument("--metrics-tls-key", default=env("METRICS_TLS_KEY", ""), help="and its private key (PEM)")
