#!/usr/bin/env python3
"""The release notes of one release, from the CHANGELOGs, and the checks that the versions agree.

  release_notes.py check VERSION [--draft]
      the tag's VERSION is the plugin's (plugin_src/pyproject.toml) and the chart's appVersion, and
      CHANGELOG.md has a section "## VERSION" (with --draft, a rehearsal, "## VERSION (unreleased)"
      or else "## Unreleased" is accepted); exit 1 naming what to fix
  release_notes.py notes VERSION --image REF@DIGEST --chart OCI_REF --collection TARBALL [--platforms P] [--draft]
      Markdown on stdout: that CHANGELOG section, the chart's own CHANGELOG section of its version,
      then how to install each artifact

scripts/release.sh runs both (so does .github/workflows/release.yml through it).
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "rdma-device-plugin"


def section(changelog: Path, version: str, draft: bool) -> str:
    """The body of "## <version>" without its heading. A draft (a rehearsal) also takes
    "## <version> (unreleased)" or, when the version has no section yet, the "## Unreleased" one
    that collects the changes until the release renames it."""
    text = changelog.read_text(encoding="utf-8")
    heading = re.compile(r"^## %s(?P<unreleased> \(unreleased\))?\s*$" % re.escape(version), re.M)
    found = heading.search(text)
    unreleased = re.search(r"^## Unreleased\s*$", text, re.M)
    if not found and draft and unreleased:
        found = unreleased
    elif not found or (found.group("unreleased") and not draft):
        what = "is still marked (unreleased)" if found else "has no section"
        rename = "; rename its '## Unreleased'" if unreleased and not found else ""
        raise SystemExit(
            f"release: {changelog.relative_to(ROOT)} {what} for {version}: write its '## {version}' section "
            f"(the release notes are taken from it{rename}), or rehearse with RELEASE_DRAFT=1"
        )
    rest = text[found.end():]
    following = re.search(r"^## ", rest, re.M)
    return rest[: following.start() if following else len(rest)].strip()


def versions() -> dict[str, str]:
    plugin = tomllib.loads((ROOT / "plugin_src" / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    galaxy = yaml.safe_load((ROOT / "galaxy.yml").read_text())
    return {"plugin": plugin, "chart": str(chart["version"]), "app": str(chart["appVersion"]),
            "collection": str(galaxy["version"])}  # fmt: skip


def check(version: str, draft: bool) -> dict[str, str]:
    v = versions()
    problems = []
    if v["plugin"] != version:
        problems.append(f"the tag says {version}, plugin_src/pyproject.toml version = {v['plugin']}")
    if v["app"] != version:
        problems.append(f"the tag says {version}, charts/rdma-device-plugin/Chart.yaml appVersion = {v['app']}")
    if problems:
        raise SystemExit("release: " + "; ".join(problems) + ". Tag the version the sources carry, or bump them.")
    section(ROOT / "CHANGELOG.md", version, draft)
    section(CHART / "CHANGELOG.md", v["chart"], draft=True)  # the chart's own sections carry no marker
    return v


def notes(args: argparse.Namespace) -> str:
    v = check(args.version, args.draft)
    chart_ref = args.chart
    chart_repo, _, chart_version = chart_ref.rpartition(":")
    lines = [
        f"# rdma-device-plugin {args.version}" + (" (draft)" if args.draft else ""),
        "",
        section(ROOT / "CHANGELOG.md", args.version, args.draft),
        "",
        f"## Helm chart {v['chart']}",
        "",
        section(CHART / "CHANGELOG.md", v["chart"], draft=True),
        "",
        "## Install",
        "",
        f"- Image ({args.platforms}): `{args.image}`",
        f"- Helm chart {chart_version}: `helm install rdma {chart_repo} --version {chart_version} --namespace kube-system`"
        " (its default image is the one above, pinned by digest)",
        f"- Ansible collection lingjun.rdma {v['collection']}: `ansible-galaxy collection install {Path(args.collection).name}`"
        " (attached to this release); then `ansible-playbook lingjun.rdma.site -i <your inventory>`",
        "",
        "Before a first deploy: docs/before-a-real-cluster.md.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check")
    c.add_argument("version")
    c.add_argument("--draft", action="store_true")
    n = sub.add_parser("notes")
    n.add_argument("version")
    n.add_argument("--image", required=True)
    n.add_argument("--chart", required=True)
    n.add_argument("--collection", required=True)
    n.add_argument("--platforms", default="linux/amd64")
    n.add_argument("--draft", action="store_true")
    args = parser.parse_args()
    if args.command == "check":
        v = check(args.version, args.draft)
        print(" ".join(f"{k}={val}" for k, val in sorted(v.items())))
    else:
        sys.stdout.write(notes(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
