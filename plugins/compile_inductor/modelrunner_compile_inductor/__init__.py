"""modelrunner-compile-inductor: the ``inductor`` compile backend (``torch.compile``) for modelrunner.

Select it with ``LLM(model, compile=True, compile_backend="inductor", compile_mode="default",
compile_cache_dir="~/.cache/modelrunner/compile", compile_options={...})``. Decode steps are
padded to a few batch buckets so a new batch size does not recompile; compiled artifacts persist
in ``compile_cache_dir`` through inductor's own caches. ``runner.stats()["compile"]`` reports
compiles, recompiles and cache hits. See the package README for the options.
"""

from __future__ import annotations

from typing import Any, Callable

from modelrunner.api import hookimpl

from .buckets import bucket_for, pad_decode_batch
from .cache import CompileCache, CompileCacheWarning, model_identity
from .options import InductorOptions

__all__ = ["BACKEND_NAME", "CompileCache", "CompileCacheWarning", "InductorOptions", "bucket_for", "cache_key",
           "compile", "pad_decode_batch", "register"]

BACKEND_NAME = "inductor"
"""The compile backend name this plugin registers."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``inductor`` compile backend."""
    registry.compile_backends(BACKEND_NAME, devices=("cpu", "cuda"), tensor_parallel=True, pipeline_parallel=True)


@hookimpl
def compile(name: str, loaded: Any, config: Any) -> Callable[..., Any] | None:
    """``torch.compile`` the model of ``loaded``.

    :raises ValueError: ``compile_mode`` or ``compile_options`` are invalid (the message lists the
        accepted values).
    """
    from .runnable import InductorModel  # torch._dynamo takes a second to import: only when compiling

    options = InductorOptions.from_config(config.mode, config.options)
    cache = CompileCache(config.cache_dir, BACKEND_NAME, cache_key(loaded, options))
    return InductorModel(loaded.model, options, cache)


def cache_key(loaded: Any, options: InductorOptions) -> dict[str, Any]:
    """Everything that shapes the compiled code of ``loaded`` under ``options`` (names its cache
    directory): :func:`~.cache.model_identity` and the options."""
    return {**model_identity(loaded, BACKEND_NAME, "modelrunner-compile-inductor"), "options": options.as_dict()}
