"""The config for a long-lived process that must not carry pydantic: validated by the one schema
(:mod:`.config`) in a short-lived child process and handed back as plain read-only values.

The DRA driver runs for the node's lifetime with a memory budget (issue 38: 50 MiB); pydantic and
the config's models are about 10 MiB of it (bench/RESULTS.md) and are needed once, to validate.
The child runs ``load_config`` (the same checks and messages as the device plugin and the chart's
tests) and prints the validated config as tagged JSON; the parent rebuilds it as :class:`Frozen`
objects with the models' field names, so code written against ``PluginConfig`` reads it the same
way. What does not cross: the models' methods (readers use plain functions such as
``Selectors.of``) and ``model_*`` calls; a test compares every field of both for several configs.

Run as ``python -m rdma_device_plugin.config_view [PATH]`` it is that child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING, Any, cast

from .config_base import ConfigError

if TYPE_CHECKING:
    from .config import PluginConfig

_MODEL, _FIELDS, _MAP = "model", "fields", "map"  # the tags of the child's JSON


class Frozen:
    """One validated config model: its fields as read-only attributes (lists and maps as values)."""

    __slots__ = ("_fields", "_kind")

    def __init__(self, kind: str, fields: dict[str, Any]) -> None:
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._fields[name]
        except KeyError:
            raise AttributeError(f"{self._kind} has no field {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{self._kind}.{name}: a validated config is read-only")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frozen) and (self._kind, self._fields) == (other._kind, other._fields)

    __hash__ = None  # type: ignore[assignment]  # as the models: their list fields are not hashable

    def __repr__(self) -> str:
        return f"{self._kind}({', '.join(f'{k}={v!r}' for k, v in self._fields.items())})"


def encode(value: Any) -> Any:
    """A validated model as JSON: models and maps tagged apart (a map's keys are data, a model's are
    field names), lists as lists, scalars as they are."""
    fields = getattr(type(value), "model_fields", None)
    if fields is not None:
        return {_MODEL: type(value).__name__, _FIELDS: {name: encode(getattr(value, name)) for name in fields}}
    if isinstance(value, dict):
        return {_MAP: {k: encode(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    raise TypeError(f"a config value of type {type(value).__name__} has no plain form: teach config_view.encode")


def decode(doc: Any) -> Any:
    if isinstance(doc, list):
        return [decode(v) for v in doc]
    if isinstance(doc, dict):
        if _MODEL in doc:
            return Frozen(doc[_MODEL], {k: decode(v) for k, v in doc[_FIELDS].items()})
        return {k: decode(v) for k, v in doc[_MAP].items()}
    return doc


class ConfigCheck:
    """The child that validates the config at ``path`` (None: the defaults), started at once so that
    it runs beside the parent's own imports; :meth:`result` waits for it."""

    def __init__(self, path: str | None) -> None:
        self.cmd = [sys.executable, "-P", "-m", __name__, *([path] if path is not None else [])]
        # the parent's import path, whichever way it was set (an installed package, PYTHONPATH, a test's
        # sys.path); -P: not the working directory's modules
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc: subprocess.Popen[str] | None = None
        self.why = ""
        try:
            self.proc = subprocess.Popen(
                self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL
            )
        except OSError as exc:
            self.why = f"{type(exc).__name__}: {exc}"

    def result(self, timeout: float = 120.0) -> PluginConfig:
        """The validated config, typed as the model for its readers (attribute reads only); ConfigError
        as ``load_config`` raises it."""
        answer = None
        if self.proc is not None:
            try:
                out, err = self.proc.communicate(timeout=timeout)
                self.why = f"exit code {self.proc.returncode}: {err.strip()[-2000:]}"
                answer = json.loads(out) if self.proc.returncode == 0 else None
            except (subprocess.TimeoutExpired, ValueError) as exc:
                self.proc.kill()
                self.proc.communicate()
                self.why = f"{type(exc).__name__}: {exc}"
        if not isinstance(answer, dict) or not ({"config", "error"} & set(answer)):
            raise ConfigError(
                f"cannot validate the config: its check ({' '.join(self.cmd)}) failed ({self.why}); run that "
                "command to see why (a broken install: reinstall the image or the package)"
            )
        if "error" in answer:
            raise ConfigError(str(answer["error"]))
        return cast("PluginConfig", decode(answer["config"]))


def load_config_view(path: str | None) -> PluginConfig:
    """The config at ``path`` (None: the defaults), validated in a child process."""
    return ConfigCheck(path).result()


def _child(argv: list[str]) -> int:
    from .config import load_config  # pydantic: in this child only

    try:
        answer = {"config": encode(load_config(argv[0] if argv else None))}
    except ConfigError as exc:
        answer = {"error": str(exc)}
    json.dump(answer, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
