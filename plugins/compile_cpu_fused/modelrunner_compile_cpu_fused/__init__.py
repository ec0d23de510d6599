"""modelrunner-compile-cpu-fused: the ``cpu_fused`` compile backend, the default on CPU where installed.

It rewrites the plain model after loading (see :mod:`.backend`): prepacked float32 weights on the
matmul path timed fastest, fused C++ ops bound onto the kernel's norm / rotary / activation / KV-write
layers, the quantized gated MLP in one kernel call, decode steps replayed from recorded graphs, and
module calls that skip ``nn.Module.__call__`` while unhooked. Outputs equal the ``eager`` backend's
within float rounding. ``LLM(model)`` on CPU runs it; ``compile=False`` / ``enforce_eager=True``
run the plain model instead; ``compile_options={"decode_graphs": False, ...}`` turns one rewrite off.
"""

from __future__ import annotations

from typing import Any, Callable

from modelrunner.api import hookimpl

from .backend import FusedModel, check_options
from .decode_graphs import register_graph_safe
from .unhooked import direct, hooked

__all__ = ["BACKEND_NAME", "FusedModel", "compile", "direct", "hooked", "register", "register_graph_safe"]

BACKEND_NAME = "cpu_fused"
"""The compile backend name this plugin registers."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``cpu_fused`` backend (CPU only; any parallel layout: the graphs turn themselves off there)."""
    registry.compile_backends(BACKEND_NAME, devices=("cpu",), tensor_parallel=True, pipeline_parallel=True)


@hookimpl
def compile(loaded: Any, config: Any) -> Callable[..., Any]:
    """Rewrite the model of ``loaded`` in place and return it wrapped in a :class:`FusedModel`.

    :raises ValueError: an unknown or malformed ``compile_options`` entry (the message lists the options).
    """
    return FusedModel(loaded.model, check_options(dict(getattr(config, "options", None) or {})))
