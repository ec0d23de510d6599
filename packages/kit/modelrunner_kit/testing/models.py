"""Driving one adapter's model by hand, as its tests (and the conformance suites) do: load it through
the kernel's routing, then feed steps of chosen tokens over a paged cache."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from modelrunner import CacheConfig
from modelrunner.api import (ForwardBatch, ForwardOutput, LoadedModel, ModelLoader, PagedBlockAllocator, ParallelState,
                             Plugins, RunnerConfig)

# Kernel internals: loading a model as the runner does needs the runner's own steps.
from modelrunner.cache_dir import cache_root  # the kernel's cache folder
from modelrunner.plugins import get_plugins  # the process's loaded plugins
from modelrunner.quantization import select_quantization  # picks the method as the runner does
from modelrunner.runner import resolve_max_model_len  # the runner's context-length rule
from modelrunner.loading.source import ModelSource, resolve_source  # reads a checkpoint as the runner does


@attrs.define
class AdapterUnderTest:
    """A model loaded by its adapter, with the hooks routed as the runner would route them."""

    loaded: LoadedModel
    """What the adapter's load (and parallelize) hook returned, with ``runnable`` set."""
    plugins: Plugins
    """The plugins the calls are routed through."""
    loader: ModelLoader
    """The loader that built it (device, dtype, ranks, attention backend, max_model_len)."""

    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> ForwardOutput:
        """The adapter's forward hook on one step."""
        out = self.plugins.call("forward", self.loaded.adapter, loaded=self.loaded, batch=batch, kv_caches=kv_caches)
        return out if isinstance(out, ForwardOutput) else ForwardOutput(logits=out)

    def process_inputs(self, prompt_text: str | None, token_ids: list[int],
                       extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]] | None:
        """The adapter's process_inputs hook on one request (None when it leaves the request as it is)."""
        return self.plugins.call("process_inputs", self.loaded.adapter, loaded=self.loaded, prompt_text=prompt_text,
                                 token_ids=token_ids, extra=extra)

    def logits(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The logits of one step."""
        return self.forward(batch, kv_caches).logits

    def parallelize(self, parallel: ParallelState) -> LoadedModel:
        """Call the adapter's parallelize hook for ``parallel`` (e.g. to check it refuses other ranks)."""
        loader = ModelLoader(self.plugins, self.loader.config, self.loader.device, self.loader.dtype, parallel,
                             self.loader.attention_backend, self.loader.max_model_len)
        return loader.parallelize(self.loaded)


def load_adapter(model: str | Path | ModelSource, config: RunnerConfig | dict[str, Any] | None = None,
                 parallel: ParallelState | None = None, plugins: Plugins | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 compile_backend: str = "eager") -> AdapterUnderTest:
    """Load ``model`` (a checkpoint path or source) exactly as the runner would — through the plugin
    that registered its architecture, parallelized, compiled by ``compile_backend`` — without sizing
    a KV cache (drive it with :class:`PagedDriver`).

    :param config: the runner configuration (default: ``block_size=4`` for steps that cross blocks);
        its ``quantization`` (and ``quantization_options``) apply as in the runner.
    """
    plugins = plugins or get_plugins()
    if config is None:
        config = RunnerConfig(cache=CacheConfig(block_size=4))
    elif isinstance(config, dict):
        config = RunnerConfig.from_dict(config)
    source = model if isinstance(model, ModelSource) else resolve_source(str(model))
    if source.quantization is None:
        method = select_quantization(config.model.quantization, config.model.quantization_options, source, plugins,
                                     cache_root(config.model.cache_dir))
        source = attrs.evolve(source, quantization=method)
    parallel = parallel or ParallelState()
    device = torch.device(device)
    backend = plugins.attention_backend(device, config.model.attention_backend)
    loader = ModelLoader(plugins, config, device, dtype, parallel, backend,
                         resolve_max_model_len(source.hf_config, config.model.max_model_len))
    loaded = loader.parallelize(loader.load(source, adapter=config.model.adapter))
    loaded.runnable = loaded.model
    loaded.runnable = plugins.compile_model(compile_backend, loaded, config.compile)
    return AdapterUnderTest(loaded, plugins, loader)


Forward = Callable[[ForwardBatch, list[torch.Tensor]], Any]
"""``(batch, kv_caches) -> logits`` (or a :class:`ForwardOutput`)."""


class PagedDriver:
    """Feeds chunks of tokens of several sequences through ``forward``, keeping their KV in a paged cache.

    Block ids come from the kernel's allocator, so sequences that grow in the same steps get
    interleaved, non-contiguous block tables.

    :param forward: runs one step (e.g. :meth:`AdapterUnderTest.forward`).
    :param spec: the model's :class:`~modelrunner.kv_cache.KVCacheSpec`.
    """

    def __init__(self, forward: Forward, spec: Any, num_blocks: int = 128, max_model_len: int = 512) -> None:
        self.forward = forward
        self.block_size = spec.block_size
        self.kv_caches = [torch.zeros(spec.layer_shape(num_blocks), dtype=spec.dtype) for _ in range(spec.num_layers)]
        """One cache tensor per layer."""
        self.allocator = PagedBlockAllocator(num_blocks, spec.block_size, max_model_len, enable_prefix_caching=False)
        """Hands out the blocks."""
        self.tokens: dict[int, list[int]] = {}
        """seq id → its tokens so far."""

    def build(self, chunks: Mapping[int, Sequence[int]], all_logits: bool = False) -> ForwardBatch:
        """The batch that computes ``chunks`` (seq id → its next tokens), allocating their slots."""
        starts, logits_rows = [], []
        for seq_id, new in chunks.items():
            new = list(new)
            if seq_id not in self.tokens:
                assert self.allocator.allocate(seq_id, new) == 0
                self.tokens[seq_id] = []
            else:
                assert self.allocator.append_slots(seq_id, new) == []
            starts.append(len(self.tokens[seq_id]))
            self.tokens[seq_id] += new
            logits_rows.append(list(range(len(new))) if all_logits else [len(new) - 1])
        return ForwardBatch.build(list(chunks), [list(c) for c in chunks.values()], starts,
                                  [self.allocator.block_table(s) for s in chunks], self.block_size, logits_rows)

    def step(self, chunks: Mapping[int, Sequence[int]], all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits of every new token (``all_logits``) or of each sequence's last one."""
        out = self.forward(self.build(chunks, all_logits), self.kv_caches)
        return out.logits if isinstance(out, ForwardOutput) else out

    def greedy(self, prompts: Mapping[int, Sequence[int]], max_new_tokens: int,
               suppress: Sequence[int] = ()) -> dict[int, list[int]]:
        """Prefill every prompt in one step, then decode all sequences together; the greedy tokens.

        :param suppress: token ids never chosen (like transformers' ``min_new_tokens`` does to EOS).
        """
        out = {seq_id: [] for seq_id in prompts}
        logits = self.step(prompts)
        for i in range(max_new_tokens):
            if suppress:
                logits[:, list(suppress)] = float("-inf")
            next_ids = logits.argmax(-1).tolist()
            for seq_id, token in zip(prompts, next_ids):
                out[seq_id].append(token)
            if i + 1 < max_new_tokens:
                logits = self.step({seq_id: [out[seq_id][-1]] for seq_id in prompts})
        return out
