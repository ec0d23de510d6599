"""The persistent compile cache: a namespaced directory that inductor's own caches fill, checked before use.

``compile_cache_dir`` holds one subdirectory per configuration, named by a hash of everything that
shapes the compiled code (model config, dtype, device, torch and Python versions, backend options),
so different configurations never share entries. Inductor writes there (its FX graph cache,
AOTAutograd cache and compiled kernels) while ``TORCHINDUCTOR_CACHE_DIR`` points at it during our
calls. We never unpickle anything from it: after each compile we record a SHA-256 of every file in
a JSON manifest, and before the first compile of a process we check the directory against it. A
file that changed (corrupt) or that we did not record (foreign) is removed with a warning, so the
graphs it belonged to are compiled again instead of loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from modelrunner.api import Attention

MANIFEST = "modelrunner-manifest.json"
"""The manifest's file name inside a namespace directory."""

_SKIP_DIRS = ("locks",)  # inductor's empty lock files: never read as cache entries

ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"
"""Where inductor (and AOTAutograd) read and write their caches."""


class CompileCacheWarning(UserWarning):
    """A file in the compile cache was corrupt or foreign and has been removed; its graphs recompile."""


def namespace_digest(key: dict[str, Any]) -> str:
    """A short stable hash of ``key`` (JSON-serialisable) naming its cache subdirectory."""
    text = json.dumps(key, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class CompileCache:
    """One namespaced cache directory (or none: ``root=None`` leaves torch's default cache alone).

    :param root: ``compile_cache_dir``; None to keep torch's own default location and skip checking.
    :param prefix: the backend's name, the start of the subdirectory's name.
    :param key: everything that shapes the compiled code; hashed into the subdirectory's name.
    """

    def __init__(self, root: str | os.PathLike | None, prefix: str, key: dict[str, Any]) -> None:
        self.key = key
        """What the namespace is keyed by."""
        self.path: Path | None = (Path(root).expanduser().resolve() / f"{prefix}-{namespace_digest(key)}"
                                  if root else None)
        """The namespace directory (None without ``compile_cache_dir``)."""
        self.warnings: list[str] = []
        """Every cache problem found so far in this process (also issued as :class:`CompileCacheWarning`)."""
        self.removed_files = 0
        """Files removed because they were corrupt or foreign."""
        self.had_entries = False
        """Whether :meth:`check` found entries written by an earlier process."""
        self._recorded: dict[str, dict[str, Any]] = {}

    # -- the environment inductor reads --------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Point inductor's caches at the namespace directory for the duration (no-op without one)."""
        if self.path is None:
            yield
            return
        before = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = str(self.path)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(ENV_VAR, None)
            else:
                os.environ[ENV_VAR] = before

    # -- checking and recording ----------------------------------------------------------------

    def check(self) -> None:
        """Remove (with a warning) every file that differs from the manifest or is missing from it."""
        if self.path is None:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self._read_manifest()
        corrupt, foreign = [], []
        for rel, path in self._files():
            entry = manifest.get(rel)
            if entry is None:
                foreign.append(rel)
            elif file_sha256(path) != entry.get("sha256"):
                corrupt.append(rel)
        for rel in corrupt + foreign:
            with contextlib.suppress(FileNotFoundError):
                (self.path / rel).unlink()
            manifest.pop(rel, None)
        self.removed_files += len(corrupt) + len(foreign)
        if corrupt or foreign:
            parts = []
            if corrupt:
                parts.append(f"{len(corrupt)} corrupt (e.g. {corrupt[0]})")
            if foreign:
                parts.append(f"{len(foreign)} foreign (e.g. {foreign[0]})")
            self.warn(f"compile cache {self.path}: removed {' and '.join(parts)} file(s) that do not match its "
                       f"manifest; the graphs they held will be recompiled")
        self._recorded = {rel: entry for rel, entry in manifest.items() if (self.path / rel).is_file()}
        self.had_entries = bool(self._recorded)
        self._write_manifest()

    def record(self) -> None:
        """Add every new or changed file to the manifest (after a compile wrote them)."""
        if self.path is None or not self.path.is_dir():
            return
        current = {}
        for rel, path in self._files():
            stat = path.stat()
            old = self._recorded.get(rel)
            if old and old.get("size") == stat.st_size and old.get("mtime_ns") == stat.st_mtime_ns:
                current[rel] = old
            else:
                current[rel] = {"sha256": file_sha256(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        # Keep what a concurrent process recorded for files still there.
        merged = {**{k: v for k, v in self._read_manifest().items() if (self.path / k).is_file()}, **current}
        self._recorded = merged
        self._write_manifest()

    def clear(self) -> None:
        """Delete the whole namespace directory (every graph recompiles)."""
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path.mkdir(parents=True, exist_ok=True)
            self._recorded = {}
            self._write_manifest()

    def warn(self, message: str) -> None:
        """Record ``message`` and issue it as a :class:`CompileCacheWarning`."""
        self.warnings.append(message)
        warnings.warn(message, CompileCacheWarning, stacklevel=3)

    def _files(self) -> Iterator[tuple[str, Path]]:
        assert self.path is not None
        for dirpath, dirnames, filenames in os.walk(self.path):
            dirnames[:] = [d for d in dirnames if not (Path(dirpath) == self.path and d in _SKIP_DIRS)]
            for name in filenames:
                path = Path(dirpath) / name
                rel = path.relative_to(self.path).as_posix()
                if rel != MANIFEST and path.is_file() and not path.is_symlink():
                    yield rel, path

    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        assert self.path is not None
        path = self.path / MANIFEST
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
            files = data["files"]
            if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
                raise ValueError("'files' is not a mapping of file entries")
            return dict(files)
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.warn(f"compile cache manifest {path} is unreadable ({type(e).__name__}: {e}); "
                       f"treating every file in {self.path} as foreign")
            return {}

    def _write_manifest(self) -> None:
        assert self.path is not None
        data = {"format": 1, "key": self.key, "files": self._recorded}
        tmp = self.path / f".{MANIFEST}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
        os.replace(tmp, self.path / MANIFEST)


def model_identity(loaded: Any, backend: str, distribution: str) -> dict[str, Any]:
    """What compiled code for ``loaded`` depends on besides the backend's own settings: versions
    (of ``distribution``, the kernel, torch, Python), machine, model class and config, attention
    backends (their kernels are called from the compiled code), dtype, device and tensor-parallel
    rank. Backends add their settings and use it as a cache key.

    Weights are not part of it: compiled graphs are keyed by the weights' shapes and dtypes and bind
    the current values when loaded.
    """
    model = loaded.model
    param = next(model.parameters(), None)
    hf_config = loaded.hf_config
    parallel = getattr(model, "parallel", None)
    return {
        "backend": backend,
        "plugin": importlib.metadata.version(distribution),
        "modelrunner": importlib.metadata.version("modelrunner"),
        "torch": torch.__version__,
        "python": list(sys.version_info[:2]),
        "machine": platform.machine(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_config": hf_config.to_dict() if hasattr(hf_config, "to_dict") else repr(hf_config),
        "attention": sorted({f"{m.backend.name} ({type(m.backend).__module__}.{type(m.backend).__qualname__})"
                             for m in model.modules() if isinstance(m, Attention)}),
        "dtype": str(param.dtype) if param is not None else None,
        "device": str(param.device.type) if param is not None else None,
        "tensor_parallel": [getattr(parallel, "tp_rank", 0), getattr(parallel, "tp_size", 1)],
    }
