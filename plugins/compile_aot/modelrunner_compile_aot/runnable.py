"""The callable the ``aot`` backend hands the runner: decode steps through the AOTInductor package.

Decode steps (one new token per sequence, the model's usual arguments, no adapter extras) run the
compiled package: no Python runs per layer, so small batches lose the interpreter's overhead.
Every other step (prompts, chunked prefills, steps carrying images or other extras) runs the eager
model, like CUDA-graph runners do: those steps are few and their shapes vary too much to be worth a
package each.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from modelrunner.api import ForwardBatch

from .decode_step import MAX_ROWS, MIN_ROWS, decode_inputs
from .package import DecodePackage


class AOTModel:
    """Runs ``model(batch, kv_caches, **kwargs)``, decode steps through a package.

    :param model: the loaded module.
    :param package: builds or loads the compiled decode step on the first decode step.
    """

    def __init__(self, model: torch.nn.Module, package: DecodePackage) -> None:
        self.model = model
        """The eager module (runs every step that is not a plain decode)."""
        self.package = package
        """The compiled decode step's store."""
        self._program: Any = None
        self._steps: collections.Counter[str] = collections.Counter()
        self._padded_rows = 0

    def __call__(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], **kwargs: Any) -> Any:
        """The model's output for this step."""
        plain = (batch.is_decode_only and not batch.extra and all(v is None for v in kwargs.values())
                 and batch.num_seqs <= MAX_ROWS)
        if not plain:
            self._steps["eager"] += 1
            return self.model(batch, kv_caches, **kwargs)
        inputs = decode_inputs(batch)
        if self._program is None:
            self._program = self.package.get(inputs, kv_caches)
        self._steps["compiled"] += 1
        rows = batch.num_seqs
        if rows < MIN_ROWS:
            self._padded_rows += MIN_ROWS - rows
        out = self._program(*inputs, kv_caches)
        return _first_rows(out, rows) if rows < MIN_ROWS else out

    def stats(self) -> dict[str, Any]:
        """Packages compiled and loaded in this process, steps run compiled and eagerly, the cache's state.

        ``graphs_from_cache`` counts packages loaded as found in ``compile_cache_dir``,
        ``graphs_from_scratch`` packages exported and compiled here (each is loaded after compiling).
        """
        cache = self.package.cache
        return {
            "backend": "aot",
            "package": str(self.package.path),
            "compiles": self.package.compiles,
            "package_loads": self.package.loads,
            "graphs_from_cache": self.package.loads - self.package.compiles,
            "graphs_from_scratch": self.package.compiles,
            "compile_seconds": round(self.package.compile_seconds, 3),
            "load_seconds": round(self.package.load_seconds, 3),
            "compiled_steps": self._steps["compiled"],
            "eager_steps": self._steps["eager"],
            "padded_rows": self._padded_rows,
            "cache_files_removed": cache.removed_files,
            "cache_warnings": list(cache.warnings),
        }


def _first_rows(value: Any, rows: int) -> Any:
    """Every tensor in ``value`` (a tensor or a tuple/list of them) cut to its first ``rows`` rows."""
    if isinstance(value, torch.Tensor):
        return value[:rows]
    if type(value) in (tuple, list):
        return type(value)(_first_rows(v, rows) for v in value)
    return value
