"""Building the project's C++ operator libraries when a package installs (never at run time).

A package with C++ kernels lists them as :class:`NativeLibrary` entries in its ``setup.py`` and passes
:func:`setup_kwargs` to ``setuptools.setup``. pip then compiles each library once per instruction-set
:data:`VARIANTS` entry the library asks for (torch's setuptools C++-extension support,
``torch.utils.cpp_extension.CppExtension``), next to the package's Python files; at import,
:mod:`modelrunner.native` loads the best build the CPU can run. A build that fails (no compiler, no
torch in the build environment) is reported by pip and skipped: the package still installs and its
pure-torch path runs.

This module is read by ``setup.py`` files before the package is installed, so it imports nothing of
modelrunner's and nothing heavy at module level. Build with ``pip install --no-build-isolation``:
an isolated build environment would download another torch to compile against.
"""

from __future__ import annotations

import os
import platform
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple


class Variant(NamedTuple):
    """One instruction-set level a library is compiled for."""

    name: str
    """The suffix of the built library's file name (``_cpu_ops_avx2``)."""
    cflags: tuple[str, ...]
    """The compiler flags that select it."""
    cpu_flags: frozenset[str]
    """The ``/proc/cpuinfo`` flags a CPU must report to run it."""


_X86_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}

VARIANTS: tuple[Variant, ...] = (
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), _X86_V4 | {"avx512_vnni"}),
    Variant("avx512", ("-march=x86-64-v4",), _X86_V4),
    Variant("avx2", ("-march=x86-64-v3",), _X86_V3),
    Variant("generic", (), frozenset()),
)
"""Every variant, best first. ``generic`` is the compiler's default target (any x86-64, or the
machine's architecture elsewhere); the others exist on x86-64 only."""

COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
"""Flags of every build. ``-ffp-contract=fast`` fuses multiply-adds, which ``-std=c++17`` turns off."""


def _is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def variants_for(names: Sequence[str]) -> list[Variant]:
    """The :data:`VARIANTS` named in ``names`` that exist on this architecture, best first."""
    unknown = set(names) - {v.name for v in VARIANTS}
    if unknown:
        raise ValueError(f"unknown instruction-set variants {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    return [v for v in VARIANTS if v.name in names and (_is_x86_64() or v.name == "generic")]


class NativeLibrary(NamedTuple):
    """A torch operator library that a package ships as C++ source and builds at install."""

    package: str
    """The dotted package its builds go into (``modelrunner.layers``)."""
    source: str
    """The ``.cpp`` file, relative to the ``setup.py`` that lists it."""
    stem: str
    """The built files' name: ``_<stem>_<variant>`` plus Python's extension suffix."""
    variants: tuple[str, ...] = ("avx512", "avx2", "generic")
    """The :data:`VARIANTS` to build: only levels whose code differs (``#ifdef __AVX512F__`` …)."""


def library_name(stem: str, variant: str) -> str:
    """The module name of one build (without the package): ``_cpu_ops_avx2``."""
    return f"_{stem}_{variant}"


def _variant_source(library: NativeLibrary, variant: Variant) -> str:
    # One translation unit per variant: builds of one source would share (and, built in parallel,
    # overwrite) one object file, and a variant could link another's code.
    path = Path("build", "native", *library.package.split("."), f"{library_name(library.stem, variant.name)}.cpp")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f'#include "{Path(library.source).resolve()}"\n'
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return str(path)


def _extensions(libraries: Sequence[NativeLibrary]) -> list[Any]:
    from torch.utils.cpp_extension import CppExtension

    extensions = []
    for library in libraries:
        for variant in variants_for(library.variants):
            extensions.append(CppExtension(
                name=f"{library.package}.{library_name(library.stem, variant.name)}",
                sources=[_variant_source(library, variant)],
                depends=[library.source],
                extra_compile_args=[*COMMON_CFLAGS, *variant.cflags],
                extra_link_args=["-fopenmp"],
                # pip reports a failed build and goes on: the package installs without it.
                optional=True,
            ))
    return extensions


def _tolerant_build_ext() -> type:
    from torch.utils.cpp_extension import BuildExtension

    class TolerantBuildExtension(BuildExtension):
        """torch's ``build_ext`` (no ninja: its errors would escape setuptools' ``optional`` handling),
        turning any failure into a warning so the package installs without its C++ kernels."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, use_ninja=False, **kwargs)

        def build_extensions(self) -> None:
            if self.parallel is None:
                self.parallel = os.cpu_count() or 1
            try:
                super().build_extensions()
            except Exception as e:  # noqa: BLE001 - e.g. no compiler: still install, without kernels
                _skip(f"{type(e).__name__}: {e}")

        def build_extension(self, ext: Any) -> None:
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - one variant failing leaves the others
                _skip(f"{ext.name}: {type(e).__name__}: {e}")

    return TolerantBuildExtension


def _skip(why: str) -> None:
    message = f"modelrunner: C++ kernels not built ({why}); the pure-torch path will run"
    print(message, file=sys.stderr)
    warnings.warn(message, stacklevel=3)


def setup_kwargs(libraries: Sequence[NativeLibrary]) -> dict[str, Any]:
    """The ``setuptools.setup(**...)`` arguments that build ``libraries`` at install; none (after one
    warning) where torch is not importable in the build environment."""
    try:
        import torch.utils.cpp_extension  # noqa: F401
    except ImportError as e:
        _skip(f"torch is not importable where pip builds ({e}); install with --no-build-isolation")
        return {}
    return {"ext_modules": _extensions(libraries), "cmdclass": {"build_ext": _tolerant_build_ext()}}


__all__ = ["COMMON_CFLAGS", "NativeLibrary", "VARIANTS", "Variant", "library_name", "setup_kwargs", "variants_for"]
