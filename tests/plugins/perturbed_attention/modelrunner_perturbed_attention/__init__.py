"""A deliberately wrong attention backend, for tests: ``perturbed_sdpa`` is ``torch_sdpa`` with each
attention output feature scaled by a fixed factor within ±``SCALE``.

It runs as fast as ``torch_sdpa`` and produces different greedy tokens, which is what ``modelrunner
bench compare`` must report as "outputs differ" (a fast but wrong backend must not look like a win).

Being wrong on purpose, it stays out of everyone's way: it registers only while the environment
variable ``MODELRUNNER_TEST_PERTURBED_ATTENTION`` is set (non-empty), so the attention contract
suite, which runs every registered backend against a reference, never sees it; and its priority
(-100) keeps it from ever being the default backend.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from modelrunner import hookimpl
from modelrunner.layers import TorchSDPABackend

ENABLE_ENV = "MODELRUNNER_TEST_PERTURBED_ATTENTION"
"""Set (non-empty) to register the backend."""
SCALE = 0.25
"""Largest relative change of an output feature."""


class PerturbedSDPABackend(TorchSDPABackend):
    """``torch_sdpa`` whose output features are each scaled by ``1 + SCALE * cos(feature index)``."""

    name = "perturbed_sdpa"
    priority = -100

    def attend(self, layer: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
               kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        out = super().attend(layer, query, key, value, kv_cache, metadata)
        features = torch.arange(out.shape[-1], device=out.device, dtype=out.dtype)
        return out * (1.0 + SCALE * torch.cos(features))


@hookimpl
def register(registry: Any) -> None:
    """Declare ``perturbed_sdpa`` when :data:`ENABLE_ENV` is set."""
    if os.environ.get(ENABLE_ENV):
        registry.attention_backends(PerturbedSDPABackend)
