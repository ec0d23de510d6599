"""Configuration: attrs frozen classes, validated on construction with messages that name the value."""

from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Any

import attrs

from .errors import did_you_mean
from .wire import register as _wire_type

DTYPES = ("auto", "float32", "float16", "bfloat16")


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")

    return check


def _seconds(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a positive number of seconds, got {value!r}")


def _int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{attribute.name} must be an integer, got {value!r}")


def _non_negative_below(limit: int):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < limit:
            raise ValueError(f"{attribute.name} must be an integer from 0 to {limit - 1}, got {value!r}")

    return check


def _dict(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"{attribute.name} must be a dict, got {value!r}")


def _optional_str(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{attribute.name} must be a path string or None, got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _fraction(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


def _name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _device(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return
    if isinstance(value, str) and (value in ("auto", "cpu", "cuda") or
                                   (value.startswith("cuda:") and value[5:].isdigit())):
        return
    raise ValueError(f"device must be 'auto', 'cpu', 'cuda', 'cuda:N' or a GPU index, got {value!r}")


@_wire_type
@attrs.frozen
class ModelConfig:
    """Which checkpoint to run and how to read it."""

    model: str = attrs.field(default="smollm2", validator=_name)
    """A local Hugging Face directory, a ``.gguf`` file, or ``smollm2`` (the default model)."""
    dtype: str = attrs.field(default="auto", validator=_one_of(DTYPES))
    """Weight and activation dtype; ``auto`` is the checkpoint's dtype on GPU and, on a CPU, float32 or
    bfloat16 as measured there (:mod:`modelrunner.cpu_dtype`)."""
    trust_remote_code: bool = attrs.field(default=False, validator=_bool)
    """Allow a checkpoint's own Python code to run (transformers' flag of the same name)."""
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    """Longest sequence (prompt + output); default: the model's ``max_position_embeddings``, at most 8192."""
    cache_dir: str | None = attrs.field(default=None, validator=_optional_str)
    """Where converted checkpoints (GGUF → safetensors) are kept; default ``$MODELRUNNER_CACHE_DIR``
    or ``~/.cache/modelrunner``."""
    tokenizer: str | None = attrs.field(default=None, validator=_optional_str)
    """A tokenizer directory to use instead of the checkpoint's own (vLLM's ``tokenizer``)."""
    quantization: str | None = attrs.field(default=None, validator=_optional_str)
    """How weights are stored and multiplied, by quantization method name (``modelrunner plugins``
    lists them); ``none`` runs dense floats; default: the method a ``.gguf`` file or the
    checkpoint's ``quantization_config`` calls for, else none."""
    quantization_options: dict = attrs.field(factory=dict, validator=_dict)
    """Options of the quantization method (e.g. ``{"group_size": 64}``), passed through untouched."""
    adapter: str | None = attrs.field(default=None, validator=_optional_str)
    """The plugin whose load hook builds the model, when several installed adapters register the
    checkpoint's architecture (``modelrunner plugins`` shows such conflicts); default: the one that does."""
    attention_backend: str | None = attrs.field(default=None, validator=_optional_str)
    """Paged-attention implementation by name (``torch_sdpa`` is the kernel's; ``modelrunner plugins``
    lists others); default: the highest-priority installed one that supports the device."""
    seed: int = attrs.field(default=0, validator=_int)
    """Seed for random initialisation and for sampling requests that do not give their own."""


@_wire_type
@attrs.frozen
class CacheConfig:
    """The paged KV cache: block size, allocator, budget."""

    block_size: int = attrs.field(default=16, validator=_positive)
    """Token slots per KV-cache block."""
    kv_allocator: str = attrs.field(default="paged", validator=_name)
    """Name of the block allocator plugin (``paged`` is the kernel's; ``modelrunner plugins`` lists others)."""
    enable_prefix_caching: bool = attrs.field(default=True, validator=_bool)
    """Reuse the KV of prompt prefixes already computed (hash of full blocks)."""
    kv_cache_memory: int | None = attrs.field(default=None, validator=_positive)
    """Bytes for the KV cache. Default on CPU: 2 GiB; on GPU: what ``gpu_memory_utilization`` leaves
    after weights and the activation peak."""
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    """Fraction of GPU memory this process may use (weights + activations + KV cache)."""


@_wire_type
@attrs.frozen
class ParallelConfig:
    """How many processes share the model."""

    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    """Ranks each layer's matrices are split across."""
    pipeline_parallel_size: int = attrs.field(default=1, validator=_positive)
    """Stages the layers are split into."""
    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    """Engine replicas, each its own process (and each a tensor × pipeline group of its own); one
    front spreads requests over them (the ``modelrunner-data-parallel`` distribution)."""
    data_parallel_size_local: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    """Replicas this machine runs (None: all of them); the others join from ``--headless`` machines."""
    data_parallel_address: str | None = attrs.field(default=None, validator=_optional_str)
    """Address the front listens on for its replicas (None: 127.0.0.1, this machine only)."""
    data_parallel_rpc_port: int = attrs.field(default=0, validator=_non_negative_below(65536))
    """Port the front listens on for its replicas (0: a free one, for replicas on this machine only)."""
    data_parallel_start_rank: int = attrs.field(default=0, validator=_non_negative_below(1 << 16))
    """Data-parallel rank of this machine's first replica (``--headless`` machines start past the front's)."""
    distributed_executor_backend: str | None = attrs.field(default=None, validator=_optional_str)
    """The executor plugin that runs each replica's ranks (vLLM's option; None: the default for the
    sizes, ``mp`` for worker processes, ``uni`` for one process); see ``modelrunner plugins``."""

    @property
    def world_size(self) -> int:
        """Processes of one replica (``tensor_parallel_size × pipeline_parallel_size``)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


@_wire_type
@attrs.frozen
class CompileConfig:
    """Which compile backend produces the callable the runner executes."""

    enabled: bool | None = attrs.field(default=None, validator=attrs.validators.optional(_bool))
    """True: run ``backend``; False (``enforce_eager=True``): the plain ``eager`` backend; None (not
    set): the device's preferred backend where it is installed, else ``eager`` (:meth:`backend_for`)."""
    backend: str = attrs.field(default="inductor", validator=_name)
    """Name of the compile backend plugin used when enabled."""
    mode: str = attrs.field(default="default", validator=_name)
    """Backend mode, e.g. torch.compile's ``default``, ``reduce-overhead``, ``max-autotune``."""
    cache_dir: str | None = attrs.field(default=None, validator=_optional_str)
    """Where compiled artifacts persist across processes (backend-specific)."""
    options: dict = attrs.field(factory=dict, validator=_dict)
    """Extra backend options, passed through untouched."""

    @property
    def backend_name(self) -> str:
        """The backend named by the config alone: ``backend`` when enabled, else ``eager`` (what runs
        when ``enabled`` is None also depends on the device and the installed backends: :meth:`backend_for`)."""
        return self.backend if self.enabled else "eager"

    def backend_for(self, device: Any, installed: Collection[str]) -> str:
        """The backend that runs on ``device`` (a ``torch.device`` or its type) when the ``installed``
        compile backends are these: :attr:`backend_name` when ``enabled`` is set, else the first of
        :data:`PREFERRED_BACKENDS` for the device that is installed, else ``eager``."""
        if self.enabled is not None:
            return self.backend_name
        kind = getattr(device, "type", str(device))
        return next((name for name in PREFERRED_BACKENDS.get(kind, ()) if name in installed), "eager")


PREFERRED_BACKENDS: dict[str, tuple[str, ...]] = {"cpu": ("cpu_fused",)}
"""Device type → compile backends run by default there when installed (``compile`` not set), best
first. ``cpu_fused`` (plugin ``modelrunner-compile-cpu-fused``) adds fused CPU ops, decode-step graphs
and prepacked weights to the plain model; elsewhere the default is ``eager``."""


@_wire_type
@attrs.frozen
class SchedulerConfig:
    """How the engine packs requests into steps."""

    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    """Most sequences running at once."""
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    """Most new tokens in one step (long prompts are prefilled in chunks of at most this)."""


def _positive_or_none(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@_wire_type
@attrs.frozen
class RequestLimits:
    """How large each list-valued sampling field of one request may be.

    A request over a limit is refused when it is added (``ValueError`` naming the field, its size and
    the limit; a server answers 400), before any work proportional to its size is done. Within the
    limits, a request's per-step cost does not grow with these fields (masks and lookup structures
    are built once, when it is added), so one large request cannot slow the others' steps.
    """

    max_allowed_token_ids: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Most entries in ``allowed_token_ids``; None: the vocabulary size (more can only repeat ids)."""
    max_logit_bias: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Most entries in ``logit_bias``; None: the vocabulary size."""
    max_stop_token_ids: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Most entries in ``stop_token_ids``; None: the vocabulary size."""
    max_stop_strings: int = attrs.field(default=128, validator=_positive)
    """Most strings in ``stop``."""
    max_stop_string_chars: int = attrs.field(default=256, validator=_positive)
    """Longest string in ``stop``, in characters (the text held back while streaming is this long)."""
    max_bad_words: int = attrs.field(default=128, validator=_positive)
    """Most words in ``bad_words`` (each is tokenized twice when the request is added)."""
    max_bad_word_chars: int = attrs.field(default=256, validator=_positive)
    """Longest word in ``bad_words``, in characters."""
    max_logits_processors: int = attrs.field(default=16, validator=_positive)
    """Most entries in ``logits_processors``."""


@_wire_type
@attrs.frozen
class StructuredOutputsConfig:
    """How requests with ``structured_outputs`` are constrained (vLLM's ``structured_outputs_config``,
    also accepted as ``LLM(structured_outputs_config={"backend": ...})``)."""

    backend: str = attrs.field(default="auto", validator=_name)
    """The grammar backend, by name: ``xgrammar`` (package ``modelrunner-grammar-xgrammar``),
    ``guidance`` (llguidance; ``modelrunner-grammar-llguidance``) or another installed one (``modelrunner
    plugins`` lists them); ``auto`` picks per request among those installed: xgrammar, or guidance for a
    feature xgrammar lacks (as vLLM does). vLLM's older ``guided_decoding_backend`` sets it too."""
    disable_any_whitespace: bool = attrs.field(default=False, validator=_bool)
    """JSON outputs without whitespace between tokens, for every request (a request can ask for it
    alone with ``StructuredOutputsParams(disable_any_whitespace=True)``)."""
    compile_threads: int = attrs.field(default=2, validator=_positive)
    """Threads that compile grammars off the engine's step (a request waits, unscheduled, until its
    grammar is ready; compiled grammars are cached by backend and schema). One more thread compiles
    only small constraints (a few choices, a short regex), so they never wait behind large ones."""
    compile_timeout_s: float = attrs.field(default=120.0, validator=_seconds)
    """Longest one grammar may take to compile, counted from when a compile thread starts it (or to
    wait for a thread); past it the requests that need it fail, naming it."""
    max_queued_compiles: int = attrs.field(default=16, validator=_positive)
    """Grammars that may wait for a compile thread (and as many small ones besides); one more is
    refused at once, naming the busy pool (the server answers 503 with Retry-After)."""
    cache_bytes: int = attrs.field(default=512 << 20, validator=_positive)
    """Memory the cache of compiled grammars may hold, estimated per grammar (xgrammar reports its
    size); the least recently used are dropped past it (a 40,000-value enum compiles to ~200 MB)."""
    mask_threads: int = attrs.field(default=2, validator=_positive)
    """Threads that advance grammars and compute token masks off the engine's step (twice this many
    while some grammars are slow: slow ones get threads of their own)."""
    mask_timeout_s: float = attrs.field(default=10.0, validator=_seconds)
    """Longest one request's grammar may take to accept a token and compute the next token mask,
    counted from when a mask thread starts (or the wait for one); past it that request fails, naming
    its grammar. Other requests never wait for it: a request whose mask is not ready sits out steps."""


_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                     "disable_by_batch_size")


def _batch_limit(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None or value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, 'auto' or None, got {value!r}")


@_wire_type
@attrs.frozen
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer guesses the next tokens of each
    decoding sequence and the target model checks them all in one forward.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5}``
    copies from the prompt and output; ``{"model": path, "num_speculative_tokens": 4}`` runs a small
    draft model. The method's name is checked against the installed proposers when the engine starts.
    """

    method: str = attrs.field(default="ngram", validator=_name)
    """The proposer, by name (``modelrunner plugins`` lists them): ``ngram`` (prompt lookup) or ``draft``
    (a draft model; implied by ``model``)."""
    num_speculative_tokens: int = attrs.field(default=4, validator=_positive)
    """Most tokens proposed per sequence and step (each step can then emit up to this plus one)."""
    prompt_lookup_min: int = attrs.field(default=1, validator=_positive)
    """``ngram``: shortest suffix of the sequence looked up in its earlier tokens."""
    prompt_lookup_max: int = attrs.field(default=5, validator=_positive)
    """``ngram``: longest suffix looked up (longer matches are tried first)."""
    model: str | None = attrs.field(default=None, validator=_optional_str)
    """``draft``: the draft model's checkpoint (its vocabulary must be the target's)."""
    disable_by_batch_size: int | str | None = attrs.field(default="auto", validator=_batch_limit)
    """When steps draft nothing: an integer (vLLM's meaning) — where at least this many sequences
    decode; ``"auto"`` — at batch sizes where steps with drafts measured slower per emitted token than
    steps without (timed on this machine as it runs); None — never (each sequence still adapts)."""

    def __attrs_post_init__(self) -> None:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft" and self.model is None:
            raise ValueError("speculative_config: method 'draft' needs 'model' (the draft checkpoint's path)")

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig:
        """vLLM's dict (``method`` defaults to ``draft`` when ``model`` is given, else ``ngram``).

        :raises ValueError: not a dict, an unknown key, or a bad value (named, with what is accepted).
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict like {'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"unknown speculative_config key {unknown[0]!r}{did_you_mean(unknown[0], _SPECULATIVE_KEYS)}"
                             f" (known: {', '.join(_SPECULATIVE_KEYS)})")
        value = dict(value)
        if value.get("method") is None:
            value["method"] = "draft" if value.get("model") is not None else "ngram"
        elif value["method"] in ("draft_model", "draft-model"):
            value["method"] = "draft"
        try:
            return cls(**value)
        except ValueError as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith("speculative_config") else f"speculative_config: {msg}") from None
@_wire_type
@attrs.frozen
class LoRAConfig:
    """LoRA adapters served over the base model (vLLM's ``enable_lora`` and its limits)."""

    enable_lora: bool = attrs.field(default=False, validator=_bool)
    """Accept requests with a ``lora_request`` (the linear layers then carry adapter slots)."""
    max_loras: int = attrs.field(default=1, validator=_positive)
    """Most distinct adapters in one step (each a slot in every LoRA-carrying layer); requests of
    other adapters wait."""
    max_lora_rank: int = attrs.field(default=16, validator=_positive)
    """Highest adapter rank accepted (slots are sized for it)."""
    max_cpu_loras: int | None = attrs.field(default=None, validator=_positive_or_none)
    """Adapters kept read in memory (least recently used dropped, read again from disk when needed);
    default ``max_loras``; at least ``max_loras``."""
    lora_kernel: str = attrs.field(default="torch", validator=_name)
    """The ``lora_kernels`` plugin that adds the deltas (``modelrunner plugins`` lists them)."""

    @max_cpu_loras.validator
    def _cpu_at_least_gpu(self, attribute: attrs.Attribute, value: int | None) -> None:
        if value is not None and value < self.max_loras:
            raise ValueError(f"max_cpu_loras ({value}) must be at least max_loras ({self.max_loras})")

    @property
    def cpu_loras(self) -> int:
        """``max_cpu_loras``, or ``max_loras`` when unset."""
        return self.max_cpu_loras or self.max_loras


def _vllm_pooling_name(value: Any) -> Any:
    """vLLM spells pooling types in capitals (``LAST``, ``MEAN``, ``CLS``); the registry's names are lowercase."""
    return value.lower() if isinstance(value, str) and value.isupper() else value


def _optional_bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True, False or None, got {value!r}")


@_wire_type
@attrs.frozen
class PoolerConfig:
    """How embedding requests pool a prompt's hidden states (vLLM's ``pooler_config``, also accepted as
    ``LLM(pooler_config={"pooling_type": "mean", "normalize": False})``)."""

    pooling_type: str | None = attrs.field(default=None, converter=_vllm_pooling_name, validator=_optional_str)
    """The pooling method, by name: ``last``, ``mean``, ``cls`` or another installed one (``modelrunner
    plugins`` lists them); None: what the checkpoint's sentence-transformers ``Pooling`` module
    says, else ``last``."""
    normalize: bool | None = attrs.field(default=None, validator=_optional_bool)
    """L2-normalise embeddings unless a request says otherwise; None: as the checkpoint's
    sentence-transformers modules say (a ``Normalize`` module), else True."""


def _device_default() -> str:
    return "auto"


@_wire_type
@attrs.frozen
class RunnerConfig:
    """Everything the runner needs; build it directly or with :meth:`from_dict`."""

    model: ModelConfig = attrs.field(factory=ModelConfig)
    """The checkpoint."""
    cache: CacheConfig = attrs.field(factory=CacheConfig)
    """The KV cache."""
    parallel: ParallelConfig = attrs.field(factory=ParallelConfig)
    """Tensor and pipeline parallelism."""
    compile: CompileConfig = attrs.field(factory=CompileConfig)
    """Compilation."""
    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    """Batching."""
    limits: RequestLimits = attrs.field(factory=RequestLimits)
    """Size limits on each request's sampling fields."""
    structured_outputs: StructuredOutputsConfig = attrs.field(factory=StructuredOutputsConfig)
    """Grammar backend for structured outputs."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None: off); vLLM's ``speculative_config`` in the flat dict."""
    lora: LoRAConfig = attrs.field(factory=LoRAConfig)
    """LoRA adapters."""
    pooling: PoolerConfig = attrs.field(factory=PoolerConfig)
    """Embeddings: the pooling method and normalisation."""
    device: str | int = attrs.field(factory=_device_default, validator=_device)
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:N`` or a GPU index."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunnerConfig:
        """Build from the article's flat dict (``{'model': ..., 'dtype': 'float16', 'compile': True, ...}``).

        Unknown keys are rejected with the closest known key suggested. vLLM's engine-argument names
        are accepted where they mean the same thing (:data:`VLLM_ALIASES`); a vLLM option modelrunner
        does not have is refused saying so (:data:`VLLM_ONLY`).
        """
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        d = _translate_vllm(d)
        sections: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
        device = d.get("device", "auto")
        speculative = d.get("speculative_config")
        speculative = None if speculative is None else SpeculativeConfig.from_dict(speculative)
        for key, value in d.items():
            if key in ("device", "speculative_config"):
                continue
            if key not in FLAT_KEYS:
                raise ValueError(
                    f"unknown config key {key!r}{did_you_mean(key, [*FLAT_KEYS, 'device', 'speculative_config'])} (known keys: {', '.join(sorted([*FLAT_KEYS, 'device', 'speculative_config']))})"
                )
            section, field = FLAT_KEYS[key]
            sections[section][field] = value
        built = {}
        for section, section_cls in _SECTIONS.items():
            try:
                built[section] = section_cls(**sections[section])
            except ValueError as e:
                msg = str(e)
                # name the flat key the user wrote, not the field behind it
                for flat, field in _RENAMED.get(section, {}).items():
                    if msg.startswith(f"{field} must"):
                        msg = flat + msg[len(field):]
                raise ValueError(msg) from None
        return cls(**built, speculative=speculative, device=device)


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "parallel": ParallelConfig,
    "compile": CompileConfig,
    "scheduler": SchedulerConfig,
    "limits": RequestLimits,
    "structured_outputs": StructuredOutputsConfig,
    "lora": LoRAConfig,
    "pooling": PoolerConfig,
}

_RENAMED = {
    "compile": {"compile": "enabled", "compile_backend": "backend", "compile_mode": "mode",
                "compile_cache_dir": "cache_dir", "compile_options": "options"},
    "structured_outputs": {f"structured_outputs_{f.name}": f.name for f in attrs.fields(StructuredOutputsConfig)},
    "pooling": {"pooling_type": "pooling_type", "pooling_normalize": "normalize"},
}
"""Section → flat key → field, for the sections whose flat keys are not their fields' names."""

FLAT_KEYS: dict[str, tuple[str, str]] = {}
"""Flat key → (section, field): every field of every section, compile's under ``compile_*``."""
for _section, _cls in _SECTIONS.items():
    for _f in attrs.fields(_cls):
        _flat = next((k for k, v in _RENAMED.get(_section, {}).items() if v == _f.name), _f.name)
        FLAT_KEYS[_flat] = (_section, _f.name)


VLLM_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory"}
"""vLLM engine-argument names that are another key's name here."""

VLLM_ONLY = ("swap_space", "cpu_offload_gb", "max_seq_len_to_capture", "disable_log_stats", "kv_cache_dtype",
             "tokenizer_mode", "revision",
             "tokenizer_revision", "code_revision", "download_dir", "load_format", "disable_custom_all_reduce",
             "max_logprobs", "limit_mm_per_prompt",
             "mm_processor_kwargs", "hf_overrides", "compilation_config", "task", "rope_scaling", "rope_theta",
             "enable_chunked_prefill", "num_scheduler_steps", "scheduling_policy", "worker_cls",
             "override_generation_config", "enable_sleep_mode", "calculate_kv_scales", "disable_async_output_proc",
             "skip_tokenizer_init", "enable_expert_parallel",
             "tokenizer_pool_size", "reasoning_parser", "logits_processors",
             "served_model_name", "allowed_local_media_path", "generation_config")
"""vLLM engine arguments modelrunner has no equivalent for; refused by name, never silently ignored."""


def _translate_vllm(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with vLLM's names mapped to ours (``enforce_eager=True`` is ``compile=False``).

    :raises ValueError: a vLLM option with no equivalent here, or ``enforce_eager=True`` with ``compile=True``.
    """
    out = {}
    for key, value in d.items():
        if key == "structured_outputs_config":
            out.update(_flat_structured_outputs(value))
            continue
        if key in ("pooler_config", "override_pooler_config"):
            out.update(_flat_pooler(value, key))
            continue
        if key == "guided_decoding_backend":
            warnings.warn("guided_decoding_backend is deprecated (as in vLLM); use "
                          "structured_outputs_config={'backend': ...}", DeprecationWarning, stacklevel=4)
            if "structured_outputs_config" in d and _flat_structured_outputs(d["structured_outputs_config"]).get(
                    "structured_outputs_backend", value) != value:
                raise ValueError("guided_decoding_backend and structured_outputs_config['backend'] disagree; keep one")
            out["structured_outputs_backend"] = value
            continue
        if key in VLLM_ONLY:
            raise ValueError(f"{key!r} is a vLLM option that modelrunner does not have; remove it (the docs' "
                             "'Coming from vLLM' table, docs/guide/offline.md, lists what maps and what does not)")
        if key == "enforce_eager":
            if not isinstance(value, bool):
                raise ValueError(f"enforce_eager must be True or False, got {value!r}")
            if value and d.get("compile") is True:
                raise ValueError("enforce_eager=True and compile=True contradict each other; keep one")
            if value:
                out["compile"] = False
            continue
        out[VLLM_ALIASES.get(key, key)] = value
    return out


def _flat_structured_outputs(value: Any) -> dict[str, Any]:
    """vLLM's ``structured_outputs_config`` (a dict or a :class:`StructuredOutputsConfig`) as flat keys."""
    if isinstance(value, StructuredOutputsConfig):
        value = attrs.asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs_config must be a dict like {{'backend': 'xgrammar'}}, got {value!r}")
    known = [f.name for f in attrs.fields(StructuredOutputsConfig)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown structured_outputs_config key {unknown[0]!r}{did_you_mean(unknown[0], known)} "
                         f"(known: {', '.join(known)})")
    return {f"structured_outputs_{k}": v for k, v in value.items()}


def _flat_pooler(value: Any, key: str = "pooler_config") -> dict[str, Any]:
    """vLLM's ``pooler_config`` (a dict or a :class:`PoolerConfig`) as flat keys."""
    if isinstance(value, PoolerConfig):
        value = attrs.asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a dict like {{'pooling_type': 'mean', 'normalize': True}}, got {value!r}")
    known = [f.name for f in attrs.fields(PoolerConfig)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"unknown {key} key {unknown[0]!r}{did_you_mean(unknown[0], known)} (known: {', '.join(known)})")
    return {("pooling_type" if k == "pooling_type" else "pooling_normalize"): v for k, v in value.items()}
