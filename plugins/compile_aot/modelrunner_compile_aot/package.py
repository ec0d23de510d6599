"""Build, store and load the AOTInductor package of a model's decode step.

The package is compiled once (``torch.export`` then ``torch._inductor.aoti_compile_and_package``)
into the namespaced cache directory and, in later processes, loaded back with torch's own loader
(``torch._inductor.aoti_load_package``, which unzips it and ``dlopen``\\ s the compiled library);
nothing is unpickled. The package holds code only: the weights stay in the live model and are
handed to the compiled program by reference (``load_constants(..., user_managed=True)``), so the
package never goes stale when a checkpoint's weights change and the weights are not held twice.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelrunner.api import onednn_in_compiled_graphs
from modelrunner_compile_inductor import CompileCache, lowerings

from .decode_step import DecodeStep, dynamic_shapes

PACKAGE_NAME = "decode.pt2"
"""The package's file name inside the namespace directory."""

_PACKAGE_SETTINGS = {"aot_inductor.package_constants_in_so": False}


class DecodePackage:
    """The compiled decode step of one model, from the cache or freshly built.

    :param step: the exportable decode step wrapping the model.
    :param cache: the namespace directory (checked before its package is trusted).
    :param inductor_settings: extra ``torch._inductor.config`` settings for the AOT compile.
    """

    def __init__(self, step: DecodeStep, cache: CompileCache, inductor_settings: dict[str, Any]) -> None:
        self.step = step
        self.cache = cache
        self.inductor_settings = inductor_settings
        self.compiles = 0
        """Packages exported and compiled in this process."""
        self.loads = 0
        """Packages loaded from the cache directory."""
        self.compile_seconds = 0.0
        """Time spent exporting and compiling."""
        self.load_seconds = 0.0
        """Time spent loading packages and binding weights."""

    @property
    def path(self) -> Path:
        """Where the package lives."""
        assert self.cache.path is not None
        return self.cache.path / PACKAGE_NAME

    def get(self, example: tuple[torch.Tensor, ...], kv_caches: list[torch.Tensor]) -> Any:
        """The loaded program with the model's weights bound: loaded if a verified package exists, else built.

        :param example: :class:`DecodeStep` inputs of one real step (shapes only matter).
        """
        self.cache.check()
        if self.path.is_file():
            try:
                return self._load()
            except Exception as e:  # a package torch cannot load: rebuild it
                self.cache.warn(f"compile cache package {self.path} could not be loaded ({type(e).__name__}: {e}); "
                                "removed it and compiling again")
                self.path.unlink(missing_ok=True)
        self._build(example, kv_caches)
        return self._load()

    def _build(self, example: tuple[torch.Tensor, ...], kv_caches: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        # Lowered, the cache write becomes an in-place scatter and the linear layers direct calls of
        # oneDNN's kernel (on the reference CPU 1.6x MKL's for one row), not calls back into Python.
        lowered = lowerings.install()
        with self.cache.active(), torch.no_grad(), onednn_in_compiled_graphs(lowered):
            program = torch.export.export(self.step, (*example, kv_caches),
                                          dynamic_shapes=dynamic_shapes(len(kv_caches)), strict=False)
            # A fresh metadata dict: AOTInductor writes into the one it is given, and a write into the
            # global default would change every later inductor cache key in this process.
            settings = {**self.inductor_settings, **_PACKAGE_SETTINGS, "aot_inductor.metadata": {}}
            torch._inductor.aoti_compile_and_package(program, package_path=str(self.path), inductor_configs=settings)
        self.cache.record()
        self.compiles += 1
        self.compile_seconds += time.perf_counter() - start

    def _load(self) -> Any:
        start = time.perf_counter()
        program = torch._inductor.aoti_load_package(str(self.path))
        bind_weights(program, self.step)
        self.loads += 1
        self.load_seconds += time.perf_counter() - start
        return program


def bind_weights(program: Any, module: nn.Module) -> None:
    """Hand ``module``'s parameters and buffers to a package compiled without them (no copies).

    :raises RuntimeError: the package expects a tensor the module does not have.
    """
    # Every name of a shared tensor (a tied LM head is the embedding under a second name).
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    wanted = program.get_constant_fqns()
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise RuntimeError(f"the package expects weights the model does not have: {', '.join(missing[:5])}")
    program.load_constants({name: tensors[name] for name in wanted}, check_full_update=True, user_managed=True)
