"""Pipeline-parallel stages: placeholders for other stages' modules, their weights skipped, and the
check that a model was built for the rank it runs on."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn


class StageMissingLayer(nn.Module):
    """Stands where a module of another pipeline stage would be, so layer indices and weight names
    still match the checkpoint; it holds no weights and refuses to be used."""

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"{name!r}: this module belongs to another pipeline stage (code walking "
                             "model.layers must skip StageMissingLayer)")

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, nn.Module):
            raise AttributeError(f"cannot set {name!r}: this module belongs to another pipeline stage")
        super().__setattr__(name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Always raises: the module runs on another pipeline stage."""
        raise RuntimeError("called a module that belongs to another pipeline stage")


class StageWeights:
    """The checkpoint tensors of the modules on ``model``'s pipeline stage; other stages' are skipped.

    :param weights: ``(name, tensor)`` pairs, e.g. :meth:`modelrunner.loading.source.ModelSource.iter_weights`.
    :param model: a model built for one pipeline stage (other stages' modules are :class:`StageMissingLayer`).
    """

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module) -> None:
        self.weights = weights
        """The whole checkpoint."""
        self.path = getattr(weights, "path", "checkpoint")
        """The checkpoint directory (named in errors)."""
        self.skipped_prefixes = tuple(f"{name}." for name, module in model.named_modules()
                                      if isinstance(module, StageMissingLayer))
        """Name prefixes of the modules that live on other stages."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, t) for name, t in self.weights if not name.startswith(self.skipped_prefixes))

    def file_of(self, name: str) -> Path | None:
        """The file a tensor came from, when the underlying checkpoint knows."""
        file_of = getattr(self.weights, "file_of", None)
        return file_of(name) if file_of else None


def check_built_for(model: nn.Module, parallel: Any) -> None:
    """Raise ``ValueError`` unless ``model`` (with a ``parallel`` attribute: the
    :class:`~modelrunner.parallel_state.ParallelState` it was built for) matches ``parallel``'s
    tensor rank and pipeline stage."""
    built = model.parallel
    if (built.tp_rank, built.tp_size) != (parallel.tp_rank, parallel.tp_size):
        raise ValueError(
            f"model was loaded for tensor-parallel rank {built.tp_rank}/{built.tp_size}, "
            f"but parallelize was called for {parallel.tp_rank}/{parallel.tp_size}; pass the same ParallelState to load"
        )
    if (built.pp_rank, built.pp_size) != (parallel.pp_rank, parallel.pp_size):
        raise ValueError(
            f"model was loaded for pipeline stage {built.pp_rank}/{built.pp_size}, "
            f"but parallelize was called for {parallel.pp_rank}/{parallel.pp_size}; pass the same ParallelState to load"
        )
