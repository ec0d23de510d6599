"""ModelRunner: one process's model — load → parallelize → compile → KV tensors → execute steps.

The runner knows devices, dtypes, the plugins and the KV-cache tensors; it does not schedule. The
block allocator that hands out its KV blocks belongs to whoever schedules (the engine's
:class:`~modelrunner.engine.scheduler.Scheduler`); the runner only reports how many blocks it holds.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import attrs
import torch

from .capabilities import check_supported, runs_quantization
from .cache_dir import cache_root
from .config import RunnerConfig
from .cpu_dtype import cpu_auto_dtype
from .distributed import STAGE_OUTPUTS, min_over_ranks
from .errors import ModelRunnerError, ModelSourceError
from .forward_batch import ForwardBatch, ForwardOutput
from .kv_cache.sizing import allocate_kv_caches, copy_blocks, kv_cache_budget, num_blocks_for_budget
from .kv_cache.spec import KVCacheSpec
from .loaded_model import LoadedModel
from .lora import LORA_DIST, MANAGER_GROUP
from .model_size import check_model_fits
from .loading.loader import ModelLoader, adapter_for
from .parallel_state import ParallelState
from .plugins import Plugins, feature_class, get_plugins
from .quantization import select_quantization, weight_bytes
from .scratch import ScratchSequences, no_engine_error
from .loading.source import ModelSource, one_line, resolve_source

logger = logging.getLogger(__name__)

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


def resolve_dtype(name: str, hf_config: Any, device: torch.device, cache_dir: Any = None) -> torch.dtype:
    """The engine's dtype: explicit names are honoured; ``auto`` is the checkpoint's dtype on GPU and,
    on a CPU, what :func:`~modelrunner.cpu_dtype.cpu_auto_dtype` chose (float32, or bfloat16 where
    the CPU computes it natively and it measured faster)."""
    return dtype_choice(name, hf_config, device, cache_dir)[0]


def dtype_choice(name: str, hf_config: Any, device: torch.device, cache_dir: Any = None) -> tuple[torch.dtype, str]:
    """:func:`resolve_dtype` and why, in one line (``stats()["dtype"]["why"]``)."""
    if name != "auto":
        return getattr(torch, name), "asked for"
    if device.type == "cpu":
        choice = cpu_auto_dtype(hf_config, cache_dir)
        return choice.dtype, choice.why
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype, "the checkpoint's dtype"
    return torch.float16, "the checkpoint names no float dtype"


def load_tokenizer_from(path: str) -> Any:
    """The tokenizer in directory ``path`` (the ``tokenizer`` config field).

    :raises ModelSourceError: ``path`` is not a directory holding a tokenizer.
    """
    from transformers import AutoTokenizer

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelSourceError(f"tokenizer {path!r}: no such directory; pass a folder with tokenizer.json (or "
                               "tokenizer_config.json) — modelrunner never downloads from a hub")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds for a folder without a tokenizer
        raise ModelSourceError(f"tokenizer {path!r}: cannot load a tokenizer from it ({one_line(e)})") from e


def resolve_max_model_len(hf_config: Any, asked: int | None) -> int:
    """``asked``, else the model's ``max_position_embeddings`` capped at :data:`MAX_DEFAULT_MODEL_LEN`.

    :raises ValueError: ``asked`` exceeds the model's ``max_position_embeddings``.
    """
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    limit = getattr(text, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
    if asked is None:
        return min(int(limit), MAX_DEFAULT_MODEL_LEN)
    if asked > limit:
        raise ValueError(f"max_model_len={asked} exceeds the model's max_position_embeddings={limit}")
    return asked


class ModelRunner:
    """Runs one model in one process (one rank's shard when parallel): the article's ModelRunner,
    with every stage a plugin hook routed to the plugin that owns the name.

    ``load_model()`` resolves the checkpoint, lets the adapter that registered its architecture
    build it, applies the parallelize and compile hooks, then sizes and allocates the paged KV
    cache. ``execute_model(batch)`` runs one step and returns a :class:`ForwardOutput`. The article's
    ``forward(input_ids)`` works on top (:attr:`scratch`), and ``generate(input_ids)`` on the engine
    attached to the runner; :class:`modelrunner.ModelRunner` (this class, plus an engine built on
    first use) is the one to use for ``generate``.

    :param config: the configuration (a :class:`RunnerConfig` or its flat dict).
    :param parallel: this process's ranks (default: a single process).
    :param plugins: the plugins to route through (default: :func:`~modelrunner.plugins.get_plugins`).
    """

    def __init__(self, config: RunnerConfig | dict[str, Any], parallel: ParallelState | None = None,
                 plugins: Plugins | None = None) -> None:
        self.config = RunnerConfig.from_dict(config) if isinstance(config, dict) else config
        """The whole configuration."""
        self.device = resolve_device(self.config.device)
        """Where the weights and the KV cache live."""
        self.parallel = parallel or ParallelState()
        """This process's tensor/pipeline ranks."""
        self.plugins = plugins or get_plugins()
        """The plugins every hook call is routed through."""
        self.dtype: torch.dtype | None = None
        """Weight and activation dtype (set by :meth:`load_model`)."""
        self.dtype_why = ""
        """Why the engine runs :attr:`dtype` (``stats()["dtype"]["why"]``)."""
        self.source: ModelSource | None = None
        """The resolved checkpoint."""
        self.loaded: LoadedModel | None = None
        """The loaded model (None until :meth:`load_model`)."""
        self.kv_caches: list[torch.Tensor] = []
        """One ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per attention layer of this rank."""
        self.num_blocks = 0
        """KV-cache blocks every layer holds (the block allocator's pool size)."""
        self.max_model_len = 0
        """Longest sequence (prompt + output) this runner serves."""
        self.quantization: Any = None
        """The quantization method the model's weights use (None: dense floats)."""
        self.lora: Any = None
        """The LoRA manager, ``modelrunner-lora``'s (None unless ``enable_lora``)."""
        self.scratch = ScratchSequences(self)
        """Runs :meth:`forward`'s scratch sequences on KV blocks of the engine's allocator (or its own)."""
        self._engine: Any = None

    # -- loading -------------------------------------------------------------------------------

    @property
    def compile_backend(self) -> str:
        """The compile backend this runner uses (:meth:`~modelrunner.config.CompileConfig.backend_for`
        its device and the installed backends)."""
        return self.config.compile.backend_for(self.device, self.plugins.registry.names("compile_backends"))

    def check_config(self) -> None:
        """Fail now, before anything loads, on names no plugin provides and on settings the chosen
        pieces cannot serve (e.g. a ``block_size`` above the attention backend's limit)."""
        cfg = self.config
        self.plugins.require("compile_backends", self.compile_backend)
        self.plugins.require("allocators", cfg.cache.kv_allocator)
        if cfg.model.attention_backend is not None:
            backend = self.plugins.attention_backend_class(cfg.model.attention_backend)
            backend.check_config(cfg.cache.block_size)

    def choose_quantization(self, source: Any) -> Any:
        """The quantization method instance for ``source`` (None: dense floats): the configured one,
        else the automatic choice (``gguf`` for a GGUF file) — except that a GGUF file routed to an
        adapter that runs dense weights only is dequantized for it (logged) rather than refused."""
        cfg = self.config
        method = select_quantization(cfg.model.quantization, cfg.model.quantization_options, source, self.plugins,
                                     cache_root(cfg.model.cache_dir))
        if method is not None and cfg.model.quantization is None and getattr(source, "gguf", None) is not None:
            adapter = adapter_for(self.plugins, source, cfg.model.adapter)
            if not runs_quantization(self.plugins, source.architecture, adapter, method.name):
                logger.info("adapter %r does not run quantization %r: dequantizing %s to dense weights", adapter,
                            method.name, source.path.name)
                return None
        return method

    def check_supported(self, source: Any, quantization: Any) -> None:
        """Refuse, before anything loads, pieces that declare they do not work together (the adapter
        ``source`` routes to with the quantization method, parallel sizes and device; see
        :mod:`modelrunner.capabilities`). The driver of a parallel group calls it before starting workers.

        :raises UnsupportedCombinationError: naming the piece and what it supports.
        """
        check_supported(self.plugins, self.config, self.device, source.architecture,
                        adapter_for(self.plugins, source, self.config.model.adapter),
                        None if quantization is None else quantization.name)

    def check_runnable(self) -> None:
        """Resolve the checkpoint (converting a GGUF file once) and check what :meth:`load_model` would
        fail on — names, supported combinations, memory — without building the model. The driver of a
        parallel group calls it before it starts any other rank, so a bad name costs no processes.

        :raises ModelRunnerError: (or ``ValueError``) what loading would fail on.
        """
        self.check_config()
        cfg = self.config.model
        source = resolve_source(cfg.model, cfg.cache_dir, cfg.trust_remote_code)
        try:
            quantization = self.choose_quantization(source)
            self.check_supported(source, quantization)
            dtype = resolve_dtype(cfg.dtype, source.hf_config, self.device, cfg.cache_dir)
            check_model_fits(source, dtype, self.device, self.config.parallel.world_size, quantization is not None)
        finally:
            source.release_weights()

    def load_model(self) -> LoadedModel:
        """Load, parallelize and compile the model, then allocate its KV cache. Idempotent."""
        if self.loaded is not None:
            return self.loaded
        self.check_config()
        cfg = self.config
        self.source = resolve_source(cfg.model.model, cfg.model.cache_dir, cfg.model.trust_remote_code)
        if cfg.model.tokenizer is None:
            self.source.prefetch_tokenizer()
        self.quantization = self.choose_quantization(self.source)
        self.source = attrs.evolve(self.source, quantization=self.quantization)
        self.dtype, self.dtype_why = dtype_choice(cfg.model.dtype, self.source.hf_config, self.device,
                                                  cfg.model.cache_dir)
        self.max_model_len = resolve_max_model_len(self.source.hf_config, cfg.model.max_model_len)
        backend = self.plugins.attention_backend(self.device, cfg.model.attention_backend)
        type(backend).check_config(cfg.cache.block_size, self.dtype)
        torch.manual_seed(cfg.model.seed)
        loader = ModelLoader(self.plugins, cfg, self.device, self.dtype, self.parallel, backend, self.max_model_len)
        self.check_supported(self.source, self.quantization)
        check_model_fits(self.source, self.dtype, self.device, cfg.parallel.world_size, self.quantization is not None)
        loaded = loader.parallelize(loader.load(self.source, adapter=cfg.model.adapter))
        if cfg.model.tokenizer is not None:
            loaded.tokenizer = load_tokenizer_from(cfg.model.tokenizer)
        loaded.runnable = loaded.model  # what the compile hook may wrap (the eager backend keeps it)
        loaded.runnable = self.plugins.compile_model(self.compile_backend, loaded, cfg.compile)
        if cfg.lora.enable_lora:
            self.lora = self._lora_manager(loaded)
        self.loaded = loaded
        self._init_kv_cache()
        return loaded

    def _lora_manager(self, loaded: LoadedModel) -> Any:
        cfg = self.config
        if cfg.parallel.pipeline_parallel_size > 1:
            raise ModelRunnerError("enable_lora does not run with pipeline_parallel_size > 1 yet; use tensor "
                                   "parallelism")
        manager_cls = feature_class(MANAGER_GROUP, "manager", LORA_DIST, "enable_lora")
        kernel_cls = self.plugins.lora_kernel_class(cfg.lora.lora_kernel)
        if kernel_cls.devices is not None and self.device.type not in kernel_cls.devices:
            raise ModelRunnerError(f"lora_kernel {cfg.lora.lora_kernel!r} runs on {', '.join(kernel_cls.devices)}, "
                                   f"not {self.device.type}")
        return manager_cls(loaded.model, cfg.lora, kernel_cls(), self.device, self.dtype)

    def add_lora(self, request: Any) -> None:
        """Read and check a LoRA adapter (:class:`~modelrunner.lora.LoRARequest`) for later steps.

        :raises ValueError: LoRA is not enabled, or the adapter is bad (a :class:`~modelrunner.lora.LoRAError`
            naming the file and the problem).
        """
        self._require_loaded()
        if self.lora is None:
            raise ValueError("a lora_request needs LoRA enabled: LLM(..., enable_lora=True) (server: --enable-lora)")
        self.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter; False when it was not added."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def _init_kv_cache(self) -> None:
        assert self.loaded is not None
        cache_cfg = self.config.cache
        spec = self.loaded.kv_cache_spec
        if spec is None:
            # The model keeps its own cache: blocks only count lengths, no KV tensors.
            self.num_blocks = math.ceil(self.max_model_len / cache_cfg.block_size) * self.config.scheduler.max_num_seqs
            return
        weights = sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())
        if self.lora is not None:
            weights += self.lora.slot_bytes
        budget = kv_cache_budget(cache_cfg, self.device, weights, self._profile_activation_peak(spec))
        num_blocks = num_blocks_for_budget(spec, budget, self.max_model_len)
        if self.parallel.world_size > 1:
            # One allocator (rank 0's engine) decides block ids for every rank: all must hold as many blocks.
            num_blocks = min_over_ranks(num_blocks, self.device)
        self.kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.num_blocks = num_blocks

    def _profile_activation_peak(self, spec: KVCacheSpec) -> int:
        """Bytes a step of ``max_num_batched_tokens`` needs beyond the weights (CUDA only; 0 on CPU)."""
        if self.device.type != "cuda" or self.config.cache.kv_cache_memory is not None:
            return 0
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        blocks = math.ceil(tokens / spec.block_size)
        caches = allocate_kv_caches(spec, blocks, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        batch = ForwardBatch.build([-1], [list(range(tokens))], [0], [list(range(blocks))], spec.block_size,
                                   [[tokens - 1]])
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

    def _run(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> ForwardOutput:
        loaded = self.loaded
        with torch.inference_mode(), self._lora_step(batch) as lora_active:
            # A step with adapters runs the plain model: its layers' LoRA hooks must run, which a
            # compiled or recorded callable may not do.
            run = attrs.evolve(loaded, runnable=loaded.model) if lora_active else loaded
            out = self.plugins.call("forward", loaded.adapter, loaded=run, batch=batch, kv_caches=kv_caches)
        if out is None:
            raise ModelRunnerError(f"adapter {loaded.adapter!r} implements no forward hook for the model it loaded")
        if not isinstance(out, ForwardOutput):
            out = ForwardOutput(logits=out)
        if STAGE_OUTPUTS not in out.aux:
            rows, wanted = tuple(out.logits.shape), batch.logits_indices.shape[0]
            if len(rows) != 2 or rows[0] != wanted:
                raise ValueError(f"adapter {loaded.adapter!r}'s forward hook returned logits of shape {list(rows)} "
                                 f"for {wanted} requested rows (batch.logits_indices); expected [{wanted}, vocab]")
        return out

    def _lora_step(self, batch: ForwardBatch) -> Any:
        if self.lora is None:
            if any(batch.lora_ids):
                raise ValueError("a step carries LoRA adapters but enable_lora is off")
            return contextlib.nullcontext(False)
        return self.lora.step(batch.lora_ids or (0,) * batch.num_seqs, batch.query_lens, batch.loras)

    def execute_model(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step; its float32 logits ``[len(batch.logits_indices), vocab]`` on the CPU, and the
        adapter's extra outputs.

        :raises ValueError: the adapter returned a different number of logits rows than asked.
        """
        self._require_loaded()
        out = self._run(batch.to(self.device), self.kv_caches)
        return ForwardOutput(logits=out.logits.float().cpu(), aux=out.aux)

    def process_inputs(self, prompt_text: str | None, token_ids: list[int],
                       extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """A request's prompt and extra inputs as the model runs them (the adapter's ``process_inputs`` hook).

        :raises ValueError: the adapter rejected them, or the request carries ``images`` and the
            model's adapter takes none.
        """
        loaded = self._require_loaded()
        result = self.plugins.call("process_inputs", loaded.adapter, loaded=loaded, prompt_text=prompt_text,
                                   token_ids=token_ids, extra=extra)
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

    def shutdown(self) -> None:
        """Nothing to stop in one process (the executor interface's method)."""

    # -- forward and generate (the article's API) ---------------------------------------------------

    def forward(self, input_ids: torch.Tensor | list, return_router_logits: bool = False
                ) -> torch.Tensor | dict[str, Any]:
        """Logits for every position of ``input_ids`` (``[L]`` or ``[B, L]``): ``[B, L, vocab]``.

        With ``return_router_logits`` (MoE models): ``{"logits": [B, L, vocab], "router_logits":
        one [B, L, num_experts] tensor per MoE layer}``. Runs scratch sequences (:attr:`scratch`).
        """
        return self.scratch.forward(input_ids, return_router_logits)

    def scratch_allocator(self) -> Any:
        """The block allocator scratch sequences use: the one an engine lent, else the runner's own."""
        return self.scratch.allocator()

    def lend_allocator(self, allocator: Any) -> None:
        """Use ``allocator`` (an engine's) for scratch sequences from now on; the engine owns it."""
        self.scratch.lend(allocator)

    def attach_engine(self, engine: Any) -> None:
        """Run :meth:`generate` through ``engine`` and scratch sequences through its allocator (an
        :class:`~modelrunner.engine.LLMEngine` calls this on the executor it runs, which passes it on)."""
        self._engine = engine
        self.lend_allocator(engine.allocator)

    def engine(self) -> Any:
        """The :class:`~modelrunner.engine.LLMEngine` attached to this runner.

        :raises ModelRunnerError: none is attached (:class:`modelrunner.ModelRunner` builds one instead).
        """
        if self._engine is None:
            raise no_engine_error(self)
        return self._engine

    def generate(self, input_ids: torch.Tensor | list, max_new_tokens: int = 16,
                 **sampling: Any) -> torch.Tensor | list[torch.Tensor]:
        """Generate up to ``max_new_tokens`` after ``input_ids`` on the :meth:`engine`; returns the new
        ids (a row stops at EOS unless ``ignore_eos``, at one of ``stop_token_ids``, or at a stop string).

        ``input_ids`` is one prompt (``[L]``: returns a tensor) or several (``[B, L]`` or a list of
        lists of any lengths: returns a list of tensors). Keyword arguments are
        :class:`~modelrunner.SamplingParams` fields (``temperature`` defaults to 0: greedy); ``n``
        and ``max_tokens`` are not among them (one completion each, ``max_new_tokens`` long at most).
        """
        return self.scratch.generate(self.engine, input_ids, max_new_tokens, **sampling)

    @property
    def block_size(self) -> int:
        """Token slots per KV-cache block."""
        return self.config.cache.block_size

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None for a checkpoint without one)."""
        return self._require_loaded().tokenizer

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """The layout of this rank's KV cache (None: the model keeps its own cache)."""
        return self._require_loaded().kv_cache_spec

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV-cache tensors."""
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def stats(self) -> dict[str, Any]:
        """What the runner knows beyond the KV blocks: ``dtype`` (``asked``: the config's, e.g.
        ``auto``; ``runs``: the activations' and KV cache's dtype it resolved to; ``why``: the CPU flags,
        override or measurement behind it), ``weights``
        (resident bytes as stored, plus any
        prepacked copy a compile backend keeps), ``quantization`` (the method, its layer formats and
        chosen kernels), ``model`` (from the model's ``runner_stats()`` when it has one, e.g. MoE
        expert token counts), ``compile`` (from the compiled callable's ``stats()``, e.g. recompiles) and
        ``adapter`` (:meth:`adapter_stats`: which plugin serves the model)."""
        loaded = self._require_loaded()
        out: dict[str, Any] = {"adapter": self.adapter_stats(),
                               "dtype": {"asked": self.config.model.dtype,
                                         "runs": str(self.dtype).removeprefix("torch."), "why": self.dtype_why}}
        compile_stats = getattr(loaded.runnable, "stats", None)
        compiled = compile_stats() if callable(compile_stats) else None
        stored = weight_bytes(loaded.model)
        packed = int((compiled or {}).get("prepacked_weight_bytes", 0))
        out["weights"] = {"bytes": stored, "prepacked_bytes": packed, "resident_bytes": stored + packed,
                          "quantization": "none" if self.quantization is None else self.quantization.name}
        if self.quantization is not None:
            out["quantization"] = self.quantization.stats(loaded.model)
        model_stats = getattr(loaded.model, "runner_stats", None)
        if callable(model_stats):
            out["model"] = model_stats()
        if compiled is not None:
            out["compile"] = compiled
        if self.lora is not None:
            out["lora"] = self.lora.stats()
        return out

    def adapter_stats(self) -> dict[str, Any]:
        """Who serves the model: the adapter plugin (entry-point name), its distribution and version,
        the checkpoint's architecture and ``model_type``, and, for a composite model, each part's adapter."""
        loaded = self._require_loaded()
        info = self.plugins.infos.get(loaded.adapter)
        config = loaded.hf_config
        out: dict[str, Any] = {"plugin": loaded.adapter, "distribution": info.distribution if info else None,
                               "version": info.version if info else None,
                               "architecture": (getattr(config, "architectures", None) or [None])[0],
                               "model_type": getattr(config, "model_type", None)}
        if loaded.parts:
            out["parts"] = {name: part.adapter for name, part in loaded.parts.items()}
        return out
