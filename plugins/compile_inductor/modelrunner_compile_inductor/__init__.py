"""modelrunner-compile-inductor: the ``inductor`` compile backend (``torch.compile``) for modelrunner.

Select it with ``LLM(model, compile=True, compile_backend="inductor", compile_mode="default",
compile_cache_dir="~/.cache/modelrunner/compile", compile_options={...})``. Decode steps are
padded to a few batch buckets so a new batch size does not recompile; compiled artifacts persist
in ``compile_cache_dir`` through inductor's own caches. ``runner.stats()["compile"]`` reports
compiles, recompiles and cache hits. See the package README for the options.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from typing import Any, Callable

import torch

from modelrunner.hookspecs import hookimpl

from .buckets import bucket_for, pad_decode_batch
from .cache import CompileCache, CompileCacheWarning
from .options import InductorOptions

__all__ = ["BACKEND_NAME", "CompileCache", "CompileCacheWarning", "InductorOptions", "bucket_for", "cache_key",
           "compile", "pad_decode_batch", "register"]

BACKEND_NAME = "inductor"
"""The compile backend name this plugin registers."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``inductor`` compile backend."""
    registry.compile_backends(BACKEND_NAME)


@hookimpl
def compile(name: str, loaded: Any, config: Any) -> Callable[..., Any] | None:
    """``torch.compile`` the model of ``loaded`` when ``name`` is ``inductor``.

    :raises ValueError: ``compile_mode`` or ``compile_options`` are invalid (the message lists the
        accepted values).
    """
    if name != BACKEND_NAME:
        return None
    from .runnable import InductorModel  # torch._dynamo takes a second to import: only when compiling

    options = InductorOptions.from_config(config.mode, config.options)
    cache = CompileCache(config.cache_dir, BACKEND_NAME, cache_key(loaded, options))
    return InductorModel(loaded.model, options, cache)


def cache_key(loaded: Any, options: InductorOptions) -> dict[str, Any]:
    """Everything that shapes the compiled code of ``loaded`` under ``options`` (names its cache directory).

    Weights are not part of it: inductor keys graphs by the weights' shapes and dtypes only and binds
    the current values when it loads a graph.
    """
    model = loaded.model
    param = next(model.parameters(), None)
    hf_config = loaded.hf_config
    parallel = getattr(model, "parallel", None)
    return {
        "backend": BACKEND_NAME,
        "plugin": importlib.metadata.version("modelrunner-compile-inductor"),
        "modelrunner": importlib.metadata.version("modelrunner"),
        "torch": torch.__version__,
        "python": list(sys.version_info[:2]),
        "machine": platform.machine(),
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_config": hf_config.to_dict() if hasattr(hf_config, "to_dict") else repr(hf_config),
        "dtype": str(param.dtype) if param is not None else None,
        "device": str(param.device.type) if param is not None else None,
        "tensor_parallel": [getattr(parallel, "tp_rank", 0), getattr(parallel, "tp_size", 1)],
        "options": options.as_dict(),
    }
