"""ModelRunner: load → parallelize → compile → KV cache → execute steps."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from .config import RunnerConfig
from .distributed import min_over_ranks
from .errors import ModelRunnerError, UnknownNameError
from .forward_batch import ForwardBatch, ForwardOutput
from .kv_cache.sizing import allocate_kv_caches, copy_blocks, kv_cache_budget, num_blocks_for_budget
from .loaded_model import LoadedModel
from .parallel_state import ParallelState
from .plugins import Plugins, get_plugins
from .source import ModelSource, resolve_source

MAX_DEFAULT_MODEL_LEN = 8192
"""Cap on the default ``max_model_len`` (a model's advertised context can be far larger than needed)."""


def resolve_device(device: str | int) -> torch.device:
    """``auto`` → CUDA when available else CPU; an int → that GPU. Unavailable CUDA is a clear error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelRunnerError(f"device {device!r} asked for, but this torch build sees no CUDA device; use 'cpu'")
    return dev


def resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """``auto`` is the checkpoint's dtype on GPU and float32 on CPU; explicit names are honoured."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float16


class ModelRunner:
    """Runs one model: the article's ModelRunner, with every stage a plugin hook.

    ``load_model()`` resolves the checkpoint, lets the load hook's adapter build it, applies the
    parallelize and compile hooks, then sizes and allocates the paged KV cache and its block
    allocator. ``execute_model(batch)`` runs one step and returns logits.
    """

    def __init__(self, config: RunnerConfig | dict[str, Any], parallel: ParallelState | None = None,
                 plugins: Plugins | None = None) -> None:
        self.config = RunnerConfig.from_dict(config) if isinstance(config, dict) else config
        self.device = resolve_device(self.config.device)
        self.parallel = parallel or ParallelState()
        self.plugins = plugins or get_plugins()
        self.dtype: torch.dtype | None = None
        self.source: ModelSource | None = None
        self.loaded: LoadedModel | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.allocator: Any = None
        self.max_model_len = 0
        self.last_aux: dict[str, Any] = {}
        """Extra outputs of the last step (e.g. ``router_logits``), when the adapter returned them."""
        self._engine: Any = None

    # -- loading -------------------------------------------------------------------------------

    def load_model(self) -> LoadedModel:
        """Load, parallelize and compile the model, then allocate its KV cache. Idempotent."""
        if self.loaded is not None:
            return self.loaded
        cfg = self.config
        self.plugins.require("compile_backends", cfg.compile.backend_name)
        self.plugins.require("allocators", cfg.cache.kv_allocator)
        if cfg.model.attention_backend is not None:
            self.plugins.require("attention_backends", cfg.model.attention_backend)
        self.source = resolve_source(cfg.model.model, cfg.model.cache_dir, cfg.model.trust_remote_code)
        self.dtype = resolve_dtype(cfg.model.dtype, self.source.hf_config, self.device)
        torch.manual_seed(cfg.model.seed)
        loaded = self.plugins.hook.load(
            source=self.source, config=cfg, device=self.device, dtype=self.dtype, parallel=self.parallel
        )
        if loaded is None:
            raise UnknownNameError(self.plugins.registry.unknown(
                "architectures", self.source.architecture or f"model_type={self.source.hf_config.model_type}",
                self.plugins.broken))
        loaded = self.plugins.hook.parallelize(loaded=loaded, parallel=self.parallel) or loaded
        loaded.runnable = self.plugins.compile_model(cfg.compile.backend_name, loaded, cfg.compile)
        self.loaded = loaded
        self.max_model_len = self._max_model_len(loaded.hf_config)
        self._init_kv_cache()
        return loaded

    def _max_model_len(self, hf_config: Any) -> int:
        text = getattr(hf_config, "get_text_config", lambda: hf_config)()
        limit = getattr(text, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
        asked = self.config.model.max_model_len
        if asked is None:
            return min(limit, MAX_DEFAULT_MODEL_LEN)
        if asked > limit:
            raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}")
        return asked

    def _init_kv_cache(self) -> None:
        assert self.loaded is not None
        cache_cfg = self.config.cache
        block_size = cache_cfg.block_size
        spec = self.loaded.kv_cache_spec
        if spec is None:
            # The model keeps its own cache: the allocator only does the bookkeeping of lengths.
            num_blocks = math.ceil(self.max_model_len / block_size) * self.config.scheduler.max_num_seqs
            cache_cfg = attrs.evolve(cache_cfg, enable_prefix_caching=False)
        else:
            weights = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
            budget = kv_cache_budget(cache_cfg, self.device, weights, self._profile_activation_peak())
            num_blocks = num_blocks_for_budget(spec, budget, self.max_model_len)
            if self.parallel.world_size > 1:
                # One allocator (rank 0's) decides block ids for every rank: all must hold as many blocks.
                num_blocks = min_over_ranks(num_blocks, self.device)
            self.kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.allocator = self.plugins.create_allocator(
            cache_cfg.kv_allocator, num_blocks, block_size, self.max_model_len, cache_cfg
        )

    def _profile_activation_peak(self) -> int:
        """Bytes a step of ``max_num_batched_tokens`` needs beyond the weights (CUDA only; 0 on CPU)."""
        if self.device.type != "cuda" or self.config.cache.kv_cache_memory is not None:
            return 0
        assert self.loaded is not None and self.loaded.kv_cache_spec is not None
        spec = self.loaded.kv_cache_spec
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        blocks = math.ceil(tokens / spec.block_size)
        caches = allocate_kv_caches(spec, blocks, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = _single_sequence_batch(list(range(tokens)), list(range(blocks)), spec.block_size,
                                       [tokens - 1], seq_id=-1)
        self._run(batch.to(self.device), caches)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches
        torch.cuda.empty_cache()
        return max(peak, 0)

    # -- execution -----------------------------------------------------------------------------

    def _require_loaded(self) -> LoadedModel:
        if self.loaded is None:
            raise ModelRunnerError("call load_model() first")
        return self.loaded

    def _run(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.plugins.hook.forward(loaded=self.loaded, batch=batch, kv_caches=kv_caches)
        if logits is None:
            raise ModelRunnerError(f"no plugin's forward hook runs models loaded by {self.loaded.adapter!r}")
        if isinstance(logits, ForwardOutput):
            self.last_aux = logits.aux
            return logits.logits
        self.last_aux = {}
        return logits

    def execute_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step; float32 logits ``[len(batch.logits_indices), vocab]`` on the CPU."""
        self._require_loaded()
        return self._run(batch.to(self.device), self.kv_caches).float().cpu()

    def process_inputs(self, prompt_text: str | None, token_ids: list[int],
                       extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """A request's prompt and extra inputs as the model runs them (the ``process_inputs`` hook).

        :raises ValueError: the adapter rejected them, or the request carries ``images`` and no
            adapter takes images for this model.
        """
        loaded = self._require_loaded()
        result = self.plugins.hook.process_inputs(loaded=loaded, prompt_text=prompt_text, token_ids=token_ids,
                                                  extra=extra)
        if result is not None:
            return result
        images = extra.get("images")
        if images is not None and not (isinstance(images, (list, tuple)) and not images):
            arch = self.source.architecture if self.source is not None else type(loaded.model).__name__
            raise ValueError(f"model {arch!r} (adapter {loaded.adapter!r}) takes no images; send a text-only "
                             "prompt, or load a vision-language checkpoint (e.g. LlavaForConditionalGeneration)")
        return token_ids, extra

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src → dst`` in every layer (copy-on-write before a step)."""
        if copies and self.kv_caches:
            copy_blocks(self.kv_caches, copies)

    @property
    def block_size(self) -> int:
        """Token slots per KV-cache block."""
        return self.config.cache.block_size

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer."""
        return self._require_loaded().tokenizer

    def memory_stats(self) -> dict[str, Any]:
        """The KV-cache pool's statistics (blocks used/free/cached, peak, prefix hits, fragmentation)."""
        self._require_loaded()
        stats = self.allocator.stats().as_dict()
        spec = self.loaded.kv_cache_spec
        stats["allocator"] = self.config.cache.kv_allocator
        stats["kv_cache_bytes"] = sum(t.numel() * t.element_size() for t in self.kv_caches)
        stats["bytes_per_token"] = spec.bytes_per_token if spec else 0
        return stats

    def stats(self) -> dict[str, Any]:
        """Every statistic the runner knows: ``kv_cache`` (see :meth:`memory_stats`), plus ``model``
        (from the model's ``runner_stats()`` when it has one, e.g. MoE expert token counts) and
        ``compile`` (from the compiled callable's ``stats()`` when it has one, e.g. recompiles)."""
        loaded = self._require_loaded()
        out: dict[str, Any] = {"kv_cache": self.memory_stats()}
        model_stats = getattr(loaded.model, "runner_stats", None)
        if callable(model_stats):
            out["model"] = model_stats()
        compile_stats = getattr(loaded.runnable, "stats", None)
        if callable(compile_stats):
            out["compile"] = compile_stats()
        return out

    # -- the article's convenience API ---------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, return_router_logits: bool = False) -> torch.Tensor | dict[str, Any]:
        """Logits for every position of ``input_ids`` (``[L]`` or ``[B, L]``): ``[B, L, vocab]``.

        With ``return_router_logits`` (MoE models): ``{"logits": [B, L, vocab], "router_logits":
        one [B, L, num_experts] tensor per MoE layer}``.
        """
        self._require_loaded()
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [L] or [B, L] with L > 0, got shape {tuple(ids.shape)}")
        extra = {"return_router_logits": True} if return_router_logits else {}
        out, routers = [], []
        for row in ids.tolist():
            seq_id = -1000 - len(out)
            out.append(self._forward_one(row, seq_id, extra))
            routers.append(self.last_aux.get("router_logits"))
        if not return_router_logits:
            return torch.stack(out)
        if any(r is None for r in routers):
            raise ModelRunnerError(f"the {self.loaded.adapter!r} adapter returned no router_logits (not an MoE model?)")
        return {"logits": torch.stack(out), "router_logits": [torch.stack(layer) for layer in zip(*routers)]}

    def _forward_one(self, tokens: list[int], seq_id: int, extra: dict[str, Any] | None = None) -> torch.Tensor:
        # A scratch sequence: no prefix reuse (all positions' logits are wanted), freed at once.
        alloc = self.allocator
        alloc.allocate(seq_id, tokens, extra_keys=("forward", seq_id, id(self)))
        try:
            batch = _single_sequence_batch(tokens, alloc.block_table(seq_id), self.block_size,
                                           list(range(len(tokens))), seq_id,
                                           slots=alloc.slot_mapping(seq_id, 0, len(tokens)))
            return self.execute_model(attrs.evolve(batch, extra=extra or {}))
        finally:
            alloc.free(seq_id)
            if self.loaded.kv_cache_spec is None:
                self.loaded.extra.get("caches", {}).pop(seq_id, None)

    def generate(self, input_ids: torch.Tensor | list, max_new_tokens: int = 16,
                 **sampling: Any) -> torch.Tensor | list[torch.Tensor]:
        """Generate up to ``max_new_tokens`` after ``input_ids``; returns the new ids.

        ``input_ids`` is one prompt (``[L]``: returns a tensor) or several (``[B, L]`` or a list of
        lists of any lengths: returns a list of tensors).

        Keyword arguments are :class:`~modelrunner.SamplingParams` fields (default greedy).
        """
        from .engine.llm_engine import LLMEngine
        from .engine.sampling_params import SamplingParams

        self._require_loaded()
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        # One prompt ([L]) or several, possibly of different lengths ([[...], [...]]).
        rows = input_ids if input_ids and isinstance(input_ids[0], (list, tuple)) else [input_ids]
        params = SamplingParams(**{"temperature": 0.0, **sampling, "max_tokens": max_new_tokens})
        if self._engine is None:
            self._engine = LLMEngine(self)
        outputs = self._engine.generate_token_ids(rows, params)
        tensors = [torch.tensor(o, dtype=torch.long) for o in outputs]
        return tensors if rows is input_ids else tensors[0]


def _single_sequence_batch(tokens: list[int], block_table: list[int], block_size: int, logits_rows: list[int],
                           seq_id: int, slots: list[int] | None = None) -> ForwardBatch:
    n = len(tokens)
    if slots is None:
        slots = [block_table[p // block_size] * block_size + p % block_size for p in range(n)]
    return ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.arange(n, dtype=torch.long),
        seq_ids=(seq_id,),
        query_start_loc=torch.tensor([0, n], dtype=torch.long),
        seq_lens=torch.tensor([n], dtype=torch.long),
        context_lens=torch.tensor([0], dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([block_table], dtype=torch.long),
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
        block_size=block_size,
        max_query_len=n,
        max_seq_len=n,
    )
