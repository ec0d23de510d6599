"""Building a plugin's C++ kernels on the machine that runs them (``torch.utils.cpp_extension``).

A kernel plugin ships its ``.cpp`` source and calls :func:`build_extension` on first use: the library
is built once per machine under ``$TORCH_EXTENSIONS_DIR``, named by a hash of the source, the flags,
torch's version and this CPU's model and feature flags — so a ``-march=native`` build is rebuilt when
any of them changes and never loaded on another kind of CPU sharing the cache directory.
"""

from __future__ import annotations

import hashlib
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import ModelRunnerError


class NativeBuildError(ModelRunnerError, RuntimeError):
    """A plugin's C++ kernels could not be built or loaded here (no compiler, no ninja, a compile error)."""


def native_cflags(march: str | None = None) -> list[str]:
    """Optimisation flags for a kernel built where it runs: ``-O3 -fopenmp -ffp-contract=fast`` and
    ``-march=native`` on x86-64 (``march`` overrides it, e.g. ``x86-64-v3``; ``""`` leaves it out).

    ``-ffp-contract=fast`` fuses multiply-adds, which the ``-std=c++NN`` torch passes turns off.
    """
    if march is None:
        march = "native" if platform.machine() in ("x86_64", "AMD64") else ""
    return ["-O3", "-fopenmp", "-ffp-contract=fast", *([f"-march={march}"] if march else [])]


def cpu_signature() -> bytes:
    """This CPU's model and feature flags (what a ``-march=native`` build depends on)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines))).encode()
    except OSError:
        return (platform.machine() + platform.processor()).encode()


def _put_ninja_on_path() -> None:
    # cpp_extension runs `ninja` from PATH; the pip package's binary is not there unless its venv is activated.
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def build_extension(prefix: str, source: Path, cflags: Sequence[str], what: str) -> str:
    """Build (unless this machine has a build of this exact source, flags, torch and CPU) and load the
    operator library ``source`` into this process; the library's name.

    :param prefix: the library name's start (a hash follows), e.g. ``modelrunner_attention_cpu``.
    :param what: the kernels in words, for the error (``the paged-attention kernel``).
    :raises NativeBuildError: the build or load failed; the message carries the compiler's complaint.
    """
    from torch.utils import cpp_extension

    key = source.read_bytes() + " ".join(cflags).encode() + torch.__version__.encode() + cpu_signature()
    name = f"{prefix}_{hashlib.sha256(key).hexdigest()[:12]}"
    _put_ninja_on_path()
    try:
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=list(cflags), extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: not available here
        raise NativeBuildError(f"could not build {what} {source}: {type(e).__name__}: {e}") from e
    return name


__all__ = ["NativeBuildError", "build_extension", "cpu_signature", "native_cflags"]
