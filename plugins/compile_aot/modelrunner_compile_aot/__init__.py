"""modelrunner-compile-aot: the ``aot`` compile backend: an ahead-of-time compiled decode step.

The first decode step exports the model's decode step with ``torch.export`` and compiles it with
AOTInductor into a package under ``compile_cache_dir``; later processes load that package with
torch's loader and start decoding at once, with no tracing or compiling. Prompt (prefill) steps
run eagerly. Select it with ``LLM(model, compile=True, compile_backend="aot",
compile_cache_dir=...)``; see the package README.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Callable

from modelrunner.api import did_you_mean, hookimpl
from modelrunner_compile_inductor import CompileCache
from modelrunner_compile_inductor.cache import model_identity
from modelrunner_compile_inductor.options import check_inductor_config
from modelrunner_compile_inductor.options import torch_compile_modes

from .decode_step import DecodeStep
from .package import DecodePackage
from .runnable import AOTModel

__all__ = ["BACKEND_NAME", "AOTModel", "DecodePackage", "DecodeStep", "cache_key", "compile", "inductor_settings",
           "register"]

BACKEND_NAME = "aot"
"""The compile backend name this plugin registers."""

OPTION_KEYS = ("inductor",)
"""The ``compile_options`` keys this backend accepts."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``aot`` compile backend."""
    registry.compile_backends(BACKEND_NAME, devices=("cpu",))


@hookimpl
def compile(name: str, loaded: Any, config: Any) -> Callable[..., Any] | None:
    """Wrap the model of ``loaded`` so its decode steps run an AOTInductor package.

    :raises ValueError: the mode or options are invalid, the model keeps its own KV cache (the
        exported step reads and writes the kernel's paged cache), or it has quantized layers.
    """
    if loaded.kv_cache_spec is None:
        raise ValueError(f"the aot compile backend needs a model on the kernel's paged KV cache; adapter "
                         f"{loaded.adapter!r} keeps its own cache. Use compile_backend='inductor' or 'eager'")
    quantized = sorted({name for name, m in loaded.model.named_modules() if getattr(m, "quant_scheme", None) is not None})
    if quantized:
        # The quantized matmuls are custom operators on weights regrouped at load: AOTInductor would
        # call each through its proxy executor and hold their storage as constants.
        raise ValueError(f"the aot compile backend does not compile quantized layers ({len(quantized)} here, e.g. "
                         f"{quantized[0]!r}); use quantization='none', or compile_backend='inductor' or 'eager'")
    settings = inductor_settings(config.mode, config.options)
    root = config.cache_dir
    if root is None:  # nowhere to persist: compile into a directory of this process only
        root = tempfile.mkdtemp(prefix="modelrunner-aot-")
        atexit.register(shutil.rmtree, root, True)
    block_size = loaded.kv_cache_spec.block_size
    cache = CompileCache(root, BACKEND_NAME, cache_key(loaded, block_size, settings))
    package = DecodePackage(DecodeStep(loaded.model, block_size).eval(), cache, settings)
    return AOTModel(loaded.model, package)


def inductor_settings(mode: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``torch._inductor.config`` settings of the AOT compile: the mode's (CUDA graphs aside) and
    ``compile_options["inductor"]``.

    :raises ValueError: naming the unknown mode, option key or inductor setting.
    """
    modes = torch_compile_modes()
    if mode not in modes:
        raise ValueError(f"compile_mode {mode!r} is not a torch.compile mode; choose one of {', '.join(modes)}")
    for key in options:
        if key not in OPTION_KEYS:
            hint = did_you_mean(key, OPTION_KEYS)
            raise ValueError(f"unknown aot compile option {key!r}{hint} (known: {', '.join(OPTION_KEYS)})")
    extra = check_inductor_config(options.get("inductor", {}))
    settings = {k: v for k, v in modes[mode].items() if not k.startswith("triton.cudagraph")}
    return {**settings, **extra}


def cache_key(loaded: Any, block_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """Everything the compiled decode step depends on (names its cache directory): the model's
    identity, the block size and the inductor settings. Not the weights: the package holds none."""
    return {**model_identity(loaded, BACKEND_NAME, "modelrunner-compile-aot"), "block_size": block_size,
            "inductor": settings}
