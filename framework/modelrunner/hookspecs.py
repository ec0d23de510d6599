"""The hooks of modelrunner: what a plugin may implement.

A plugin is a module (or object) with functions decorated by :data:`hookimpl` and named like the
specs below; it is found through the ``modelrunner`` entry-point group. Every argument is passed by
keyword, and an implementation may accept any subset of a spec's arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import torch

    from .config import CacheConfig, CompileConfig, RunnerConfig
    from .forward_batch import ForwardBatch, ForwardOutput
    from .kv_cache.allocator import BlockAllocator
    from .loaded_model import LoadedModel
    from .parallel_state import ParallelState
    from .registry import Registry
    from .source import ModelSource

hookspec = pluggy.HookspecMarker("modelrunner")
hookimpl = pluggy.HookimplMarker("modelrunner")


@hookspec
def register(registry: Registry) -> None:
    """Declare the names this plugin provides, so they can be listed and looked up.

    Called once per plugin when plugins load. Call ``registry.architectures(...)`` with the HF
    ``architectures`` / GGUF architecture names your load hook accepts, ``registry.allocators(...)``
    with the KV-cache allocator names your allocate hook answers, and
    ``registry.compile_backends(...)`` with your compile backend names.

    :param registry: collects the names; it records which plugin gave each one.
    """


@hookspec(firstresult=True)
def load(
    source: ModelSource, config: RunnerConfig, device: torch.device, dtype: torch.dtype, parallel: ParallelState
) -> LoadedModel | None:
    """Build the model for a checkpoint and load its weights.

    Return None unless you recognise ``source.architecture`` (or ``source.hf_config``).

    :param source: the resolved checkpoint: a local HF directory with its config and tokenizer.
    :param config: the whole runner configuration (parallel sizes, trust_remote_code, ...).
    :param device: where the weights must end up.
    :param dtype: the floating-point dtype for weights and activations.
    :param parallel: this process's ranks; build tensor-parallel layers for ``parallel.tp_rank`` so
        each rank loads only its shard (world size 1 when not parallel).
    :returns: the loaded model, its tokenizer, and its KV-cache spec.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def forward(
    loaded: LoadedModel, batch: ForwardBatch, kv_caches: list[torch.Tensor]
) -> torch.Tensor | ForwardOutput | None:
    """Run the model over one step's flattened batch.

    Return None unless ``loaded.model`` is yours. Call ``loaded.runnable`` (the compiled form
    chosen by the compile hook) rather than ``loaded.model`` directly. ``wrapper=True``
    implementations may observe or time the call.

    :param loaded: what your load hook returned, with ``runnable`` set.
    :param batch: tokens, positions, slot mapping and block tables of every scheduled sequence.
    :param kv_caches: one tensor per attention layer, ``[2, num_blocks, block_size, kv_heads,
        head_dim]``, already allocated; write new K/V at ``batch.slot_mapping``.
    :returns: float logits ``[len(batch.logits_indices), vocab_size]``, or a
        :class:`~modelrunner.forward_batch.ForwardOutput` carrying them plus named extra outputs.
        Under pipeline parallelism a stage after the first reads the previous stage's tensors
        from ``batch.extra["stage_inputs"]``, and a stage before the last returns
        ``ForwardOutput(<empty logits>, aux={"stage_outputs": {name: tensor}})`` for the next one
        (``modelrunner.distributed.STAGE_INPUTS`` / ``STAGE_OUTPUTS``).

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def process_inputs(
    loaded: LoadedModel, prompt_text: str | None, token_ids: list[int], extra: dict[str, Any]
) -> tuple[list[int], dict[str, Any]] | None:
    """Turn a request's prompt and extra inputs into what the model runs, before it is queued.

    Called once per request, after tokenization. Return None unless ``loaded.model`` is yours and
    the request needs changing (text-only models never implement it). Multimodal adapters
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
def parallelize(loaded: LoadedModel, parallel: ParallelState) -> LoadedModel | None:
    """Apply the tensor/pipeline-parallel plan for this rank to your model.

    Called after load, on every rank, even when the world size is 1 (then do nothing and return
    ``loaded``). Return None unless ``loaded.model`` is yours.

    :param loaded: the loaded model.
    :param parallel: this process's ranks and process groups.
    :returns: the (possibly replaced) loaded model.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def compile(name: str, loaded: LoadedModel, config: CompileConfig) -> Callable[..., Any] | None:
    """Produce the callable the forward hook will run in place of ``loaded.model``.

    Return None unless ``name`` is one of your compile backends.

    :param name: the backend asked for (``compile_backend`` in the config, ``"eager"`` when off).
    :param loaded: the loaded (and parallelized) model.
    :param config: compile mode, cache directory and backend options.
    :returns: a callable with the same signature as ``loaded.model``.

    Stops at first non-None result.
    """


@hookspec(firstresult=True)
def allocate(name: str, num_blocks: int, block_size: int, max_model_len: int, config: CacheConfig) -> BlockAllocator | None:
    """Create the KV-cache block allocator called ``name``.

    Return None unless ``name`` is one of your allocators.

    :param name: the allocator asked for (``kv_allocator`` in the config).
    :param num_blocks: blocks in the preallocated cache.
    :param block_size: token slots per block.
    :param max_model_len: the longest sequence the engine will run.
    :param config: the cache configuration (prefix caching on or off, ...).
    :returns: a fresh allocator.

    Stops at first non-None result.
    """
