"""The package's compiled code kept on the node, for the runs Ansible ships it in a zip.

AnsiballZ sends module_utils as source inside the module's zip, and zipimport compiles every
module of it at every run (it neither reads nor writes ``.pyc`` there), twice: its find_spec asks
its get_filename, which compiles the source, and exec_module compiles it again (CPython 3.11-3.14,
python/cpython#141276). For this package that was about 0.1 s of CPU a node per validate run, most
of the node module's cost beyond ansible's own ping (bench/fleet.py, issue 40). :func:`install`
puts a finder in front of the package's zip directory that names a module's file without compiling
it, loads its code from ``~/.cache/lingjun-rdma/bytecode`` when it was compiled before from the
very same source, and compiles it once and keeps it there otherwise.

Trusted as Python trusts ``__pycache__``, by ownership: the directory and every file must belong
to the user running the module and be writable by nobody else, or the cache is passed by and the
source compiled as before. A file is named by the SHA-256 of the interpreter's magic number, the
module name and the source, so an upgraded collection or another Python never reads stale code;
a new version of a module replaces the older file of the same module. Outside a zip (the device
plugin, the tests' checkout) nothing changes: Python's own ``__pycache__`` is used there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import marshal
import os
import stat
import sys
import tempfile
import zipimport
from types import CodeType, ModuleType
from typing import Any

CACHE_DIR = os.path.join("~", ".cache", "lingjun-rdma", "bytecode")


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _cache_dir() -> str | None:
    """The cache directory, made 0700 if missing; None when it is not the user's own."""
    path = os.path.expanduser(CACHE_DIR)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and _trusted(st) else None


class _CachedLoader:
    """zipimport's loader for one module, with the compiled code read from or written to the cache."""

    def __init__(self, zipped: zipimport.zipimporter, directory: str) -> None:
        self._zipped = zipped
        self._dir = directory

    def create_module(self, spec: Any) -> None:
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        exec(self.get_code(module.__name__), module.__dict__)

    def get_code(self, fullname: str) -> CodeType:
        source = self._zipped.get_source(fullname)
        if source is None:  # no source in the zip: zipimport's own way
            code = self._zipped.get_code(fullname)
            assert code is not None
            return code
        filename, data = self.get_filename(fullname), source.encode("utf-8")
        key = hashlib.sha256(importlib.util.MAGIC_NUMBER + fullname.encode() + b"\0" + data).hexdigest()[:32]
        path = os.path.join(self._dir, f"{fullname}-{key}.pyc")
        cached = _load(path)
        if cached is not None:
            return cached
        code = compile(data, filename, "exec", dont_inherit=True)
        _keep(self._dir, fullname, path, code)
        return code

    # What importlib, linecache and tracebacks ask a loader for: the zip's answers.
    def get_source(self, fullname: str) -> str | None:
        return self._zipped.get_source(fullname)

    def get_filename(self, fullname: str) -> str:
        # Not zipimport's get_filename, which compiles the module to learn its path (CPython 3.11-3.12).
        return os.path.join(self._zipped.archive, self._zipped.prefix, fullname.rpartition(".")[2] + ".py")

    def is_package(self, fullname: str) -> bool:
        return self._zipped.is_package(fullname)

    def get_data(self, path: str) -> bytes:
        return self._zipped.get_data(path)


def _load(path: str) -> CodeType | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not _trusted(os.fstat(fh.fileno())):
                return None
            code = marshal.load(fh)
    except (OSError, EOFError, ValueError, TypeError):
        return None
    return code if isinstance(code, CodeType) else None


def _keep(directory: str, fullname: str, path: str, code: CodeType) -> None:
    """Write atomically; drop the module's older versions. A cache that cannot be written is no error."""
    try:
        fd, partial = tempfile.mkstemp(prefix=".", suffix=".pyc", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as fh:
            marshal.dump(code, fh)
        os.replace(partial, path)
    except OSError:
        os.unlink(partial)
        return
    prefix, kept = f"{fullname}-", os.path.basename(path)
    try:
        for name in os.listdir(directory):
            if name.startswith(prefix) and name.endswith(".pyc") and name != kept:
                os.unlink(os.path.join(directory, name))
    except OSError:
        pass


class _CachedFinder:
    """Stands in the path importer cache for the package's directory inside the zip."""

    def __init__(self, zipped: zipimport.zipimporter, directory: str) -> None:
        self._zipped = zipped
        self._loader = _CachedLoader(zipped, directory)

    def find_spec(self, fullname: str, target: ModuleType | None = None) -> Any:
        try:
            package = self._zipped.is_package(fullname)
        except zipimport.ZipImportError:
            return None  # not in the zip
        if package:  # no subpackages here: zipimport's way (its find_spec compiles what it finds)
            return self._zipped.find_spec(fullname, target)
        return importlib.util.spec_from_file_location(
            fullname,
            self._loader.get_filename(fullname),
            loader=self._loader,  # type: ignore[arg-type]
        )

    def invalidate_caches(self) -> None:
        self._zipped.invalidate_caches()


def install(package: ModuleType) -> bool:
    """Serve the package's submodules through the cache when it was imported from a zip; whether it does."""
    if not isinstance(getattr(package, "__loader__", None), zipimport.zipimporter):
        return False
    directory = _cache_dir()
    if directory is None:
        return False
    for entry in package.__path__:
        sys.path_importer_cache[entry] = _CachedFinder(zipimport.zipimporter(entry), directory)
    return True
