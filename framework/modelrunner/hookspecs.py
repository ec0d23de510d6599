"""The hooks of modelrunner: what a plugin may implement.

A plugin is a module (or object) with functions decorated by :data:`hookimpl` and named like the
specs below; it is found through the ``modelrunner`` entry-point group. Every argument is passed by
keyword, and an implementation may accept any subset of a spec's arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

PLUGIN_API_VERSION = "1.2"
"""The version of what plugins implement (hooks, base classes, the model contract); ``CHANGELOG.md``
records every change to it. A plugin states the range it was built for as a module attribute
``PLUGIN_API = ">=1.0,<2"`` (a PEP 440 specifier); outside it, the plugin is listed as broken."""

if TYPE_CHECKING:
    import torch

    from .config import CacheConfig, CompileConfig, RunnerConfig
    from .forward_batch import ForwardBatch, ForwardOutput
    from .kv_cache.allocator import BlockAllocator
    from .layers.attention_backend import AttentionBackend
    from .loaded_model import LoadedModel
    from .loading.loader import ModelLoader
    from .parallel_state import ParallelState
    from .registry import Registry
    from .loading.source import ModelSource

hookspec = pluggy.HookspecMarker("modelrunner")
hookimpl = pluggy.HookimplMarker("modelrunner")


@hookspec
def register(registry: Registry) -> None:
    """Declare the names this plugin provides, so they can be listed and every call for them routed here.

    Called once per plugin when plugins load. Call ``registry.architectures(...)`` with the HF
    ``architectures`` names your load hook accepts, ``registry.allocators(...)`` with the KV-cache
    allocator names your allocate hook answers, ``registry.compile_backends(...)`` with your compile
    backend names, and ``registry.attention_backends(cls)`` / ``registry.logits_processors(cls)`` /
    ``registry.quantization_methods(cls)`` / ``registry.matmul_kernels(cls)`` /
    ``registry.grammar_backends(cls)`` / ``registry.tool_parsers(cls)`` / ``registry.proposers(cls)`` /
    ``registry.lora_kernels(cls)`` / ``registry.executors(cls)`` / ``registry.pooling_methods(cls)`` with
    classes of those kinds. The kernel calls your other hooks only for the names you declare here.

    :param registry: collects the names; it records which plugin gave each one.
    """


@hookspec(firstresult=True)
def load(
    source: ModelSource, config: RunnerConfig, device: torch.device, dtype: torch.dtype, parallel: ParallelState,
    attention_backend: AttentionBackend, max_model_len: int, loader: ModelLoader,
) -> LoadedModel | None:
    """Build the model for a checkpoint and load its weights.

    Called only on the plugin that registered ``source.architecture`` (or, for an architecture
    nobody registered, on a generic adapter that registered ``AutoModelForCausalLM``). Returning
    None is an error for a plugin that registered the architecture.

    :param source: the resolved checkpoint: a local HF directory with its config and tokenizer.
    :param config: the whole runner configuration (parallel sizes, trust_remote_code, ...).
    :param device: where the weights must end up.
    :param dtype: the floating-point dtype for weights and activations.
    :param parallel: this process's ranks; build tensor-parallel layers for ``parallel.tp_rank`` so
        each rank loads only its shard (world size 1 when not parallel).
    :param attention_backend: the attention backend instance the model's
        :class:`~modelrunner.layers.Attention` layers must use (chosen by the runner from the
        ``attention_backend`` config field or the device).
    :param max_model_len: the longest sequence (prompt + output) the runner will serve; size
        position tables for it.
    :param loader: loads another checkpoint (or part of this one) the same way: ``loader.load(source)``
        routes to the plugin that registered its architecture (a multimodal adapter loads its
        language model so).
    :returns: the loaded model, its tokenizer, and its KV-cache spec.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def forward(
    loaded: LoadedModel, batch: ForwardBatch, kv_caches: list[torch.Tensor]
) -> torch.Tensor | ForwardOutput | None:
    """Run the model over one step's flattened batch.

    Called only on the plugin that loaded ``loaded`` (``wrapper=True`` implementations of any plugin
    wrap it, to observe or time the call). Call ``loaded.runnable`` (the compiled form chosen by the
    compile hook, same signature as ``loaded.model``: ``(batch, kv_caches, **inputs)``) rather than
    ``loaded.model`` directly.

    :param loaded: what your load hook returned, with ``runnable`` set.
    :param batch: tokens, positions, slot mapping and block tables of every scheduled sequence.
    :param kv_caches: one tensor per attention layer, ``[2, num_blocks, block_size, kv_heads,
        head_dim]``, already allocated; write new K/V at ``batch.slot_mapping``.
    :returns: float logits ``[len(batch.logits_indices), vocab_size]``, or a
        :class:`~modelrunner.forward_batch.ForwardOutput` carrying them plus named extra outputs.
        Under pipeline parallelism a stage after the first reads the previous stage's tensors
        from ``batch.extra["stage_inputs"]``, and a stage before the last returns
        ``ForwardOutput(<empty logits>, aux={"stage_outputs": {name: tensor}})`` for the next one
        (``modelrunner.distributed.STAGE_INPUTS`` / ``STAGE_OUTPUTS``). When
        ``batch.extra["return_hidden_states"]`` holds token rows (embedding requests run in the step),
        the last stage also returns their final hidden states, after the final norm, as
        ``aux["hidden_states"]`` (``modelrunner.forward_batch.RETURN_HIDDEN_STATES`` / ``HIDDEN_STATES``;
        :func:`modelrunner.models.run_stage` does it).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def process_inputs(
    loaded: LoadedModel, prompt_text: str | None, token_ids: list[int], extra: dict[str, Any]
) -> tuple[list[int], dict[str, Any]] | None:
    """Turn a request's prompt and extra inputs into what the model runs, before it is queued.

    Called once per request, after tokenization, only on the plugin that loaded ``loaded`` (text-only
    models never implement it; return None to leave the request unchanged). Multimodal adapters
    preprocess images here (e.g. ``extra["images"]`` → ``pixel_values``) and expand each image
    placeholder into the number of tokens its features fill. The returned ``extra`` is what the
    forward hook later sees in ``batch.extra`` and what the prefix cache fingerprints, so it must
    describe the inputs by content. Raise ``ValueError`` naming the bad value to reject the
    request (only that request fails).

    :param loaded: the loaded model.
    :param prompt_text: the prompt as text, when it was given as text.
    :param token_ids: the prompt's token ids.
    :param extra: the request's other inputs (e.g. ``{"images": [PIL.Image, ...]}``).
    :returns: ``(token_ids, extra)`` to queue instead.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def parallelize(loaded: LoadedModel, parallel: ParallelState, loader: ModelLoader) -> LoadedModel | None:
    """Apply the tensor/pipeline-parallel plan for this rank to your model.

    Called after load, on every rank, even when the world size is 1 (then do nothing), only on the
    plugin that loaded ``loaded``, after the kernel parallelized its ``parts``. An adapter without
    this hook runs with world size 1 only.

    :param loaded: the loaded model.
    :param parallel: this process's ranks and process groups.
    :param loader: the kernel's loader (``loader.parallelize(part)`` for parts you manage yourself).
    :returns: the (possibly replaced) loaded model; None keeps ``loaded``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def compile(name: str, loaded: LoadedModel, config: CompileConfig, model: Any = None) -> Callable[..., Any] | None:
    """Produce the callable the forward hook will run in place of ``loaded.model``.

    Called only on the plugin that registered the backend ``name``. To build on the kernel's eager
    backend (the plain model) wrap ``loaded.runnable``, which holds the eager
    callable when this hook runs, rather than ``loaded.model``. A callable with a ``stats()`` method
    has its dict shown in ``ModelRunner.stats()["compile"]``.

    :param name: the backend asked for (``compile_backend`` in the config, ``"eager"`` when off).
    :param loaded: the loaded (and parallelized) model.
    :param config: compile mode, cache directory and backend options.
    :param model: deprecated (plugin API 1.1; goes in 2.0): ``loaded.runnable``, for implementations
        of the older ``compile(model, config)`` form; they keep working with a ``DeprecationWarning``.
    :returns: a callable with the same signature as ``loaded.model``: ``(batch, kv_caches, **inputs)``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def allocate(name: str, num_blocks: int, block_size: int, max_model_len: int, config: CacheConfig) -> BlockAllocator | None:
    """Create the KV-cache block allocator called ``name``.

    Called only on the plugin that registered the allocator ``name``.

    :param name: the allocator asked for (``kv_allocator`` in the config).
    :param num_blocks: blocks in the preallocated cache.
    :param block_size: token slots per block.
    :param max_model_len: the longest sequence the engine will run.
    :param config: the cache configuration (prefix caching on or off, ...).
    :returns: a fresh allocator.

    Stops at first non-None result.
    """
