"""Versions that cannot mix (issue 31): a config written for a newer plugin is refused with a message
that says so (not "workloadEnv: unknown key"), and the config schema cannot change without a new
plugin version (the chart's appVersion and the image tag are that version: charts tests check them).

    .venv/bin/python plugin_src/tests/test_version.py --write   # record this version's config schema
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rdma_device_plugin import __version__
from rdma_device_plugin.config import ConfigError, config_json_schema, load_config_data, load_config_text, release

SCHEMAS = Path(__file__).resolve().parent / "data" / "config-schema"


def test_a_config_for_a_newer_plugin_is_refused_precisely() -> None:
    """The 1.1.0 chart's config (workloadEnv) met an older plugin: the plugin says which versions meet."""
    data = {"version": "v1", "pluginVersion": "0.3.0", "workloadEnv": {"enabled": True}, "futureKey": 1}
    with pytest.raises(ConfigError) as err:
        load_config_data(data, "config.yaml", running="0.2.4")
    msg = str(err.value)
    assert "written for rdma-device-plugin 0.3.0" in msg and "this plugin is 0.2.4" in msg
    assert "unknown key" not in msg and "image.digest" in msg


@pytest.mark.parametrize("written_for", ["0.2.0", "0.2.9", "0.1.0", "0.2.0-rc.1"])
def test_same_or_older_minor_is_read(written_for: str) -> None:
    cfg = load_config_data({"version": "v1", "pluginVersion": written_for}, running="0.2.0")
    assert cfg.plugin_version == written_for


def test_unknown_own_version_does_not_refuse() -> None:
    assert load_config_data({"version": "v1", "pluginVersion": "9.0.0"}, running="0.0.0+unknown").mode == "shared"


def test_plugin_version_must_be_a_release() -> None:
    with pytest.raises(ConfigError, match="pluginVersion"):
        load_config_text("version: v1\npluginVersion: latest\n")


def test_release_parsing() -> None:
    assert release("0.2.0") == (0, 2) and release("1.10.3-rc.1") == (1, 10)
    assert release("latest") is None and release("0.0.0+unknown") is None


def test_the_installed_plugin_refuses_a_newer_config(tmp_path: Path) -> None:
    """End to end through `serve`: exit 2 (bad config) with the message, before anything is served."""
    major, minor = release(__version__) or (0, 0)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump({"version": "v1", "pluginVersion": f"{major}.{minor + 1}.0", "newKey": True}))
    dp = tmp_path / "dp"
    dp.mkdir()
    cmd = [sys.executable, "-m", "rdma_device_plugin", "serve", "--config", str(cfg), "--device-plugin-dir", str(dp)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"written for rdma-device-plugin {major}.{minor + 1}.0" in proc.stderr and "newKey" not in proc.stderr
    assert list(dp.iterdir()) == []


def test_config_schema_changes_only_with_a_new_version() -> None:
    """Each plugin version has its config schema recorded; a schema change under the same version
    (what let 0.1.0 mean two configs) fails until the version in pyproject.toml is bumped."""
    recorded = SCHEMAS / f"{__version__}.json"
    assert recorded.is_file(), (
        f"no config schema recorded for plugin {__version__}: run plugin_src/tests/test_version.py --write"
    )
    fix = (
        "the config schema changed: bump version in plugin_src/pyproject.toml (and the chart's appVersion), "
        "then run plugin_src/tests/test_version.py --write"
    )
    assert json.loads(recorded.read_text(encoding="utf-8")) == config_json_schema(), fix


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        SCHEMAS.mkdir(parents=True, exist_ok=True)
        path = SCHEMAS / f"{__version__}.json"
        path.write_text(json.dumps(config_json_schema(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"recorded the config schema of plugin {__version__} in {path}")
    else:
        sys.exit("usage: test_version.py --write")
