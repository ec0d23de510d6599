"""The conformance suite of a model adapter: one architecture name, checked against transformers.

:class:`AdapterSuite` runs a tiny random-weight checkpoint of the architecture (or one you give)
through ``LLM`` routed to the plugin under test, and compares with transformers' own model on the
same weights: every position's logits of prompts that span several KV blocks, and greedy tokens
under continuous batching, chunked prefill, prefix-cache hits, preemption, every attention backend
that runs on the suite's device (the CPU unless ``device=`` says otherwise), and (when the adapter
declares it) two tensor-parallel ranks.

For the generic fallback name (``AutoModelForCausalLM``) the checkpoint is of an architecture no
loaded plugin registers (the first of :data:`GENERIC_ARCHITECTURES`, or ``checkpoint=`` /
``config=``), so that the fallback adapter is the one that serves it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

from modelrunner.registry import FALLBACK_ARCHITECTURE  # kernel internal: the transformers fallback's name
from .base import Check, ConformanceError, NotApplicable, Suite, expect
from .models import (
    UnknownConfigField,
    checkpoint_config,
    load_config,
    make_llm,
    reference_greedy,
    reference_logits,
    reference_model,
    scratch_root,
    tiny_checkpoint,
    tiny_config,
)

LOGITS_ATOL = 1e-4
"""Largest |logit − transformers' logit| (and |log-probability − transformers'|) accepted in float32."""
TP_LOGITS_ATOL = 1e-4
"""The same bound for two tensor-parallel ranks."""
BLOCK_SIZE = 4
"""KV-cache block size of every run: the prompts below span 2 to 6 blocks."""
PROMPT_LENGTHS = (5, 9, 13, 17)
"""Prompt lengths: each ends one token into a new block of :data:`BLOCK_SIZE`."""
NEW_TOKENS = 6
"""Tokens generated per prompt (greedy, EOS ignored)."""
CHUNK_TOKENS = 8
"""``max_num_batched_tokens`` of the chunked-prefill runs: longer prompts are prefilled in pieces."""
MAX_NUM_SEQS = 3
"""Sequences running at once in the continuous-batching run: later prompts join while others decode."""
MAX_MODEL_LEN = 64
"""``max_model_len`` of every run (lowered to the model's ``max_position_embeddings`` when smaller)."""
PREFIX_TOKENS = 16
"""Shared prefix of the prefix-cache check: four full blocks."""
KV_CACHE_MEMORY = 256 * 2**20
"""KV-cache bytes of every run (on CUDA the default would take most of the GPU for each of the suite's
runs, and the suite holds several at once)."""
PREEMPTION_MAX_MODEL_LEN = 24
"""``max_model_len`` of the preemption run, whose KV cache holds exactly one such sequence."""
GENERIC_ARCHITECTURES = ("GPT2LMHeadModel", "OPTForCausalLM", "GPTNeoXForCausalLM", "BloomForCausalLM")
"""Architectures the fallback adapter is checked on by default: the first no loaded plugin registers."""
_ALLOW_ENV, _BLOCK_ENV = "MODELRUNNER_PLUGINS", "MODELRUNNER_BLOCK_PLUGINS"


def _env_names(var: str) -> list[str] | None:
    value = os.environ.get(var)
    return None if value is None else [n.strip() for n in value.split(",") if n.strip()]


def _first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


class AdapterSuite(Suite):
    """The checks of one architecture an adapter registered, against transformers on the same weights.

    :param name: the architecture (``LlamaForCausalLM``), or ``AutoModelForCausalLM`` for a fallback adapter.
    :param plugins: the loaded plugins (default: the process's); the runs route through them.
    :param plugin: the adapter plugin under test (default: the one the kernel would pick).
    :param checkpoint: a transformers checkpoint directory of the architecture to use instead of a tiny one.
    :param config: what to build the tiny checkpoint from instead of the suite's tiny config of the
        architecture: a transformers config (its ``architectures`` names the class; set to ``name``
        when empty), a path to a config JSON file or a folder holding ``config.json``, or a mapping of
        fields to override in the suite's tiny config (``{"use_parallel_residual": False}``).
    :param root: where tiny checkpoints are written (default: this process's own scratch folder,
        :func:`~.models.scratch_root`); reused when present.
    :param seed: the tiny checkpoint's weight seed.
    :param tensor_parallel: run the ``tensor-parallel=2`` check (it starts a worker process); False
        reports it skipped.
    :param device: where the runs go (``cpu``, ``cuda``, ``cuda:N``); transformers' reference stays on
        the CPU in float32. Every check is skipped where the plugin declares other devices, and the
        tensor-parallel check on CUDA needs two GPUs.
    :raises ValueError: no loaded plugin provides ``name``, or ``plugin`` does not.
    """

    kind = "architectures"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, checkpoint: str | Path | None = None,
                 config: Any = None, root: str | Path | None = None, seed: int = 0,
                 tensor_parallel: bool = True, device: str = "cpu") -> None:
        import torch

        super().__init__(name, plugins, plugin)
        self.device = str(torch.device(device))
        """Where the runs go (the ``device`` of every ``LLM`` the suite builds)."""
        registry = self.plugins.registry
        providers = registry.providers["architectures"].get(name, [])
        if self.plugin is None:
            self.plugin = self.plugins.require("architectures", name)
        elif self.plugin not in providers:
            raise ValueError(f"plugin {self.plugin!r} does not provide architecture {name!r}; it is provided by "
                             f"{', '.join(map(repr, providers)) or 'no loaded plugin'}")
        if checkpoint is not None and config is not None:
            raise ValueError("give checkpoint= or config=, not both")
        self.capabilities = registry.capabilities("architectures", name, self.plugin)
        """What the plugin declared for the architecture (``tensor_parallel``, ``devices`` …)."""
        self.fallback = name == FALLBACK_ARCHITECTURE
        """Whether the name under test is the generic fallback (checked on another architecture)."""
        self.root = Path(root) if root is not None else scratch_root()
        """Where tiny checkpoints go."""
        self.seed = seed
        """The tiny checkpoint's seed."""
        self.tensor_parallel = tensor_parallel
        """Whether the tensor-parallel check runs."""
        self._checkpoint = None if checkpoint is None else Path(checkpoint)
        self._config = config
        if self.fallback and checkpoint is None and (config is None or isinstance(config, Mapping)):
            taken = set(registry.providers["architectures"])
            self._generic = next((a for a in GENERIC_ARCHITECTURES if a not in taken), None)
        else:
            self._generic = None
        self._llms: dict[str, Any] = {}
        self._greedy: dict[tuple[int, ...], list[int]] = {}

    # -- set-up, built once and shared by the checks ---------------------------------------------

    def check_config(self) -> None:
        """Refuse ``config=`` overrides naming a field the tiny config lacks, before any check runs
        (each check would fail on it). Other problems with the config are left to the checks to report.

        :raises UnknownConfigField: naming the field, the closest ones and the config's own fields.
        """
        if not isinstance(self._config, Mapping) or not self._config or self._checkpoint is not None:
            return
        architecture = self._generic if self.fallback else self.name
        if architecture is None:
            return
        try:
            tiny_config(architecture, None if self.fallback else self.capabilities.get("model_type"),
                        dict(self._config))
        except UnknownConfigField:
            raise
        except ValueError:
            return

    @cached_property
    def checkpoint(self) -> Path:
        """The checkpoint directory every check runs (written on first use when tiny)."""
        if self._checkpoint is not None:
            path = self._checkpoint
        elif self._config is not None and not isinstance(self._config, Mapping):
            path = tiny_checkpoint(self._own_config(), self.root, self.seed)
        else:
            if self.fallback and self._generic is None:
                raise ValueError(f"every architecture of {', '.join(GENERIC_ARCHITECTURES)} is registered by a loaded "
                                 f"plugin, so none reaches the fallback adapter {self.plugin!r}; pass checkpoint= or "
                                 "config= of an architecture no plugin registers")
            architecture = self._generic if self.fallback else self.name
            overrides = dict(self._config or {})
            if not overrides and self.capabilities.get("model_type") is None:
                path = tiny_checkpoint(architecture, self.root, self.seed)
            else:
                config = tiny_config(architecture, None if self.fallback else self.capabilities.get("model_type"),
                                     overrides)
                path = tiny_checkpoint(config, self.root, self.seed)
        problem = self._routing_problem(self.plugins, self._architecture_of(path))
        if problem is not None:
            raise ValueError(problem)
        return path

    def _own_config(self) -> Any:
        """The transformers config given as ``config=`` (an object, or read from a path)."""
        config = self._config if hasattr(self._config, "to_json_string") else load_config(self._config)
        if not getattr(config, "architectures", None) and not self.fallback:
            config.architectures = [self.name]
        return config

    @staticmethod
    def _architecture_of(path: Path) -> str | None:
        return (checkpoint_config(path).get("architectures") or [None])[0]

    @property
    def architecture(self) -> str | None:
        """The checkpoint's architecture (``name`` itself unless checking the fallback)."""
        return self._architecture_of(self.checkpoint)

    def _routing_problem(self, plugins: Any, architecture: str | None) -> str | None:
        """Why ``plugins`` would not route a checkpoint of ``architecture`` to this suite's plugin (None: it would)."""
        registry = plugins.registry
        if self.fallback:
            registered = registry.candidates("architectures", architecture) if architecture else []
            if registered:
                return (f"the checkpoint's architecture {architecture!r} is registered by "
                        f"{', '.join(map(repr, registered))}, so the fallback adapter {self.plugin!r} would not serve "
                        "it; check it on an architecture no loaded plugin registers")
            try:
                fallback = registry.owner("architectures", FALLBACK_ARCHITECTURE)
            except Exception as e:  # noqa: BLE001 - a conflict between fallbacks is a reason like any other
                return str(e)
            if fallback != self.plugin:
                return f"the fallback architecture goes to plugin {fallback!r} there, not {self.plugin!r}"
        else:
            if architecture != self.name:
                return (f"the checkpoint's architecture is {architecture!r}, not {self.name!r}; pass a checkpoint of "
                        f"{self.name}")
            if self.plugin not in registry.providers["architectures"].get(self.name, []):
                return f"plugin {self.plugin!r} is not loaded there"
        if plugins.pm.get_plugin(self.plugin) is not self.plugins.pm.get_plugin(self.plugin):
            return f"plugin {self.plugin!r} there is not the module under test"
        return None

    @cached_property
    def hf_config(self) -> Any:
        """The checkpoint's transformers config (its text part for a composite model)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(self.checkpoint))
        return getattr(config, "get_text_config", lambda: config)()

    @cached_property
    def max_model_len(self) -> int:
        """:data:`MAX_MODEL_LEN`, or the model's own limit when lower."""
        limit = getattr(self.hf_config, "max_position_embeddings", None) or MAX_MODEL_LEN
        return min(MAX_MODEL_LEN, int(limit))

    @cached_property
    def reference(self) -> Any:
        """transformers' model on the checkpoint (float32)."""
        return reference_model(self.checkpoint)

    @cached_property
    def prompts(self) -> list[list[int]]:
        """One random prompt of each of :data:`PROMPT_LENGTHS` (ids 3 … vocab-1: no special tokens)."""
        return self._random_prompts(PROMPT_LENGTHS, seed=1)

    def _random_prompts(self, lengths: tuple[int, ...], seed: int) -> list[list[int]]:
        import torch

        vocab = int(self.hf_config.vocab_size)
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]

    def greedy(self, prompt: list[int], max_tokens: int = NEW_TOKENS) -> list[int]:
        """transformers' greedy continuation of ``prompt`` (the first ``max_tokens`` of :data:`NEW_TOKENS`)."""
        key = tuple(prompt)
        if key not in self._greedy:
            self._greedy[key] = reference_greedy(self.reference, prompt, NEW_TOKENS)
        return self._greedy[key][:max_tokens]

    def llm_config(self, **overrides: Any) -> dict[str, Any]:
        """The flat config of a run: the suite's device, float32, :data:`BLOCK_SIZE`, routed to the plugin
        under test."""
        config: dict[str, Any] = {"dtype": "float32", "device": self.device, "block_size": BLOCK_SIZE,
                                  "max_model_len": self.max_model_len, "kv_cache_memory": KV_CACHE_MEMORY, "seed": 0}
        if not self.fallback:
            config["adapter"] = self.plugin  # the fallback is reached by having no other adapter, not by choice
        config.update(overrides)
        return config

    def llm(self, key: str, **overrides: Any) -> Any:
        """The ``LLM`` called ``key`` (built once with :meth:`llm_config` plus ``overrides``)."""
        if key not in self._llms:
            llm = make_llm(self.checkpoint, self.plugins, **self.llm_config(**overrides))
            adapter = llm.runner.loaded.adapter
            expect(adapter == self.plugin, f"the model was loaded by plugin {adapter!r}, not by {self.plugin!r}")
            self._llms[key] = llm
        return self._llms[key]

    @property
    def chunked(self) -> Any:
        """The run with :data:`CHUNK_TOKENS`-token prefill chunks (logits and chunked-prefill checks)."""
        return self.llm("chunked", max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=len(PROMPT_LENGTHS))

    @property
    def batched(self) -> Any:
        """The run with whole-prompt prefills and :data:`MAX_NUM_SEQS` seats (batching and prefix-cache checks)."""
        return self.llm("batched", max_num_seqs=MAX_NUM_SEQS)

    # -- helpers of the checks -----------------------------------------------------------------------

    @property
    def _device_type(self) -> str:
        return self.device.partition(":")[0]

    def _require_device(self) -> None:
        devices = self.capabilities.get("devices")
        if devices is not None and self._device_type not in devices:
            raise NotApplicable(f"{self.plugin!r} declares devices {', '.join(devices)} for {self.name}, not "
                                f"{self._device_type} (the suite runs on {self.device})")

    def _generate(self, llm: Any, prompts: list[list[int]], max_tokens: list[int] | None = None,
                  **params: Any) -> list[Any]:
        from modelrunner import SamplingParams

        max_tokens = max_tokens or [NEW_TOKENS] * len(prompts)
        sampling = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, **params) for m in max_tokens]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        for i, out in enumerate(outputs):
            expect(not out.error, f"prompt {i} ({len(prompts[i])} tokens) failed: {out.error}")
        return outputs

    def _expect_greedy(self, what: str, prompts: list[list[int]], outputs: list[Any],
                       max_tokens: list[int] | None = None) -> None:
        max_tokens = max_tokens or [NEW_TOKENS] * len(prompts)
        for i, (prompt, out, n) in enumerate(zip(prompts, outputs, max_tokens)):
            got, want = list(out.outputs[0].token_ids), self.greedy(prompt, n)
            if got != want:
                k = _first_difference(got, want)
                raise ConformanceError(
                    f"{what}: prompt {i} ({len(prompt)} tokens) differs from transformers' greedy tokens from "
                    f"generated token {k} on: got {got}, expected {want}")

    def _sliding_window(self) -> bool:
        from modelrunner.models.decoder import sliding_windows_of  # kernel internal: the windows the engine reads

        try:
            return any(w is not None for w in sliding_windows_of(self.hf_config, self.max_model_len))
        except AttributeError:  # a config without num_hidden_layers: no per-layer windows to read
            return getattr(self.hf_config, "sliding_window", None) is not None

    # -- the checks ------------------------------------------------------------------------------------

    def checks(self) -> list[Check]:
        """``logits``, ``greedy/*`` (continuous batching, chunked prefill, prefix cache, preemption, one per
        attention backend of the device), ``lora`` and ``tensor-parallel=2``."""
        checks = [
            Check("logits", self.check_logits),
            Check("greedy/continuous-batching", self.check_continuous_batching),
            Check("greedy/chunked-prefill", self.check_chunked_prefill),
            Check("greedy/prefix-cache", self.check_prefix_cache),
            Check("greedy/preemption", self.check_preemption),
        ]
        for backend in self.plugins.attention_backends(self._device_type):
            checks.append(Check(f"greedy/attention={backend}", lambda b=backend: self.check_attention_backend(b)))
        checks.append(Check("lora", self.check_lora))
        checks.append(Check("tensor-parallel=2", self.check_tensor_parallel))
        return checks

    def check_lora(self) -> str:
        """A random PEFT LoRA (non-zero B) on every projection of the seven the model has: one batch of a
        request with the adapter and one without gives transformers + peft's greedy tokens for each.
        Skipped without peft installed, for a model with none of the projections, and for an adapter
        whose model is not built from the kernel's linear layers."""
        import copy

        import torch

        from modelrunner import LoRARequest
        try:
            from modelrunner_lora import TARGETS, LoRAError  # what a bad LoRA request raises; what it may target
        except ImportError:
            raise NotApplicable("modelrunner-lora is not installed (pip install modelrunner-lora): LoRA is not "
                                "checked") from None

        self._require_device()
        try:
            import peft
        except ImportError:
            raise NotApplicable("peft is not installed (pip install peft): LoRA is not checked") from None
        names = [n for n, _ in self.reference.named_modules()]
        targets = [t for t in TARGETS if any(n.endswith("." + t) for n in names)]
        if any(".experts." in n for n in names):  # expert projections carry no LoRA: the attention's do
            targets = [t for t in targets if t in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if not targets:
            raise NotApplicable(f"the model has none of the LoRA target projections ({', '.join(TARGETS)})")
        torch.manual_seed(self.seed)
        model = peft.get_peft_model(copy.deepcopy(self.reference), peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.1)
        folder = self.root / f"lora-{self.checkpoint.name}"
        model.save_pretrained(str(folder))
        try:
            llm = self.llm("lora", enable_lora=True, max_loras=1, max_lora_rank=4, max_num_seqs=2)
        except LoRAError as e:
            raise NotApplicable(f"the model does not run LoRA adapters: {e}") from None
        prompts = self.prompts[:2]
        sampling = [dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)] * 2
        from modelrunner import SamplingParams

        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(**s) for s in sampling],
                               lora_request=[LoRARequest("conformance", 1, str(folder)), None], use_tqdm=False)
        model.eval()
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            expect(not out.error, f"prompt {i} failed: {out.error}")
            got = list(out.outputs[0].token_ids)
            want = reference_greedy(model, prompt, NEW_TOKENS) if i == 0 else self.greedy(prompt)
            what = "with the adapter" if i == 0 else "of the base model, beside the adapter's"
            expect(got == want, f"prompt {i} {what} differs from transformers + peft: got {got}, expected {want}")
        return f"adapter on {', '.join(targets)}"

    def check_logits(self) -> str:
        """Every position's logits of each prompt (one prefill over several blocks) within :data:`LOGITS_ATOL`
        of transformers'; and, with prefill chunks of :data:`CHUNK_TOKENS`, each prompt token's and each
        generated token's log-probability within it too. Returns the largest difference, in words."""
        import torch

        self._require_device()
        llm = self.chunked
        worst = 0.0
        for i, prompt in enumerate(self.prompts):
            got = llm.runner.forward(prompt)[0].cpu()
            want = reference_logits(self.reference, prompt)
            expect(tuple(got.shape) == tuple(want.shape),
                   f"prompt {i} ({len(prompt)} tokens): logits of shape {list(got.shape)}, transformers' "
                   f"{list(want.shape)}")
            per_position = (got - want).abs().amax(-1)
            diff = per_position.max().item() if per_position.isfinite().all() else float("inf")
            if not diff <= LOGITS_ATOL:
                bad = int((~(per_position <= LOGITS_ATOL)).nonzero()[0, 0])
                raise ConformanceError(
                    f"prompt {i} ({len(prompt)} tokens, block_size {BLOCK_SIZE}): logits differ from transformers' "
                    f"by up to {diff:.3g} (first at position {bad}), tolerance {LOGITS_ATOL:g}")
            worst = max(worst, diff)
        outputs = self._generate(llm, self.prompts, prompt_logprobs=0, logprobs=0)
        for i, (prompt, out) in enumerate(zip(self.prompts, outputs)):
            generated = list(out.outputs[0].token_ids)
            tokens = prompt + generated
            want = torch.log_softmax(reference_logits(self.reference, tokens), -1)
            got_prompt = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
            got_new = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, generated)]
            got = torch.tensor(got_prompt + got_new)
            expected = want[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
            per_token = (got - expected).abs()
            diff = per_token.max().item() if per_token.isfinite().all() else float("inf")
            if not diff <= LOGITS_ATOL:
                where = int(per_token.argmax())
                phase = (f"prompt token {where + 1}" if where < len(prompt) - 1
                         else f"generated token {where - len(prompt) + 1}")
                raise ConformanceError(
                    f"prompt {i} ({len(prompt)} tokens) prefilled in chunks of {CHUNK_TOKENS}: log-probabilities "
                    f"differ from transformers' by up to {diff:.3g} (at {phase}), tolerance {LOGITS_ATOL:g}")
            worst = max(worst, diff)
        return f"max |difference| {worst:.3g} (tolerance {LOGITS_ATOL:g})"

    def check_continuous_batching(self) -> None:
        """Five prompts of mixed lengths and lengths of output, at most :data:`MAX_NUM_SEQS` at once (later
        ones join while others decode): each gives transformers' greedy tokens."""
        self._require_device()
        prompts = self.prompts + self._random_prompts((7,), seed=2)
        max_tokens = [NEW_TOKENS, 3, NEW_TOKENS, 4, NEW_TOKENS]
        outputs = self._generate(self.batched, prompts, max_tokens)
        self._expect_greedy("continuous batching", prompts, outputs, max_tokens)

    def check_chunked_prefill(self) -> None:
        """The prompts together with prefill chunks of :data:`CHUNK_TOKENS` tokens: transformers' greedy tokens."""
        self._require_device()
        outputs = self._generate(self.chunked, self.prompts)
        self._expect_greedy(f"chunked prefill (max_num_batched_tokens={CHUNK_TOKENS})", self.prompts, outputs)

    def _require_paged(self, llm: Any, what: str) -> Any:
        spec = llm.runner.kv_cache_spec
        if spec is None:
            raise NotApplicable(f"the model keeps its own KV cache (no paged cache spec): {what}")
        return spec

    def check_prefix_cache(self) -> str:
        """A prompt, then prompts sharing its first :data:`PREFIX_TOKENS` tokens: the second round gets
        prefix-cache hits and both give transformers' greedy tokens. Returns the tokens found cached."""
        self._require_device()
        llm = self.batched
        self._require_paged(llm, "no prefix cache to hit")
        prefix, a, b, c = self._random_prompts((PREFIX_TOKENS, 3, 2, 5), seed=3)
        first, second = [prefix + a], [prefix + b, prefix + c]
        outputs = self._generate(llm, first)
        self._expect_greedy("prefix cache, first round", first, outputs)
        before = llm.memory_stats()["prefix_hits"]
        outputs = self._generate(llm, second)
        hits = llm.memory_stats()["prefix_hits"] - before
        expect(hits > 0, f"prefix cache: prompts sharing their first {PREFIX_TOKENS} tokens "
                         f"({PREFIX_TOKENS // BLOCK_SIZE} full blocks) with a finished one got no prefix-cache hits")
        self._expect_greedy(f"prefix cache, second round ({hits} prompt tokens cached)", second, outputs)
        return f"{hits} prompt tokens from the prefix cache"

    def check_preemption(self) -> str:
        """A KV cache of exactly one sequence of :data:`PREEMPTION_MAX_MODEL_LEN` tokens and four prompts:
        sequences are preempted and recomputed, and each still gives transformers' greedy tokens. Returns
        the number of preemptions."""
        self._require_device()
        spec = self._require_paged(self.batched, "no blocks to run out of")
        max_len = min(PREEMPTION_MAX_MODEL_LEN, self.max_model_len)
        budget = spec.bytes_per_block * math.ceil(max_len / BLOCK_SIZE)
        llm = self.llm("preemption", max_model_len=max_len, kv_cache_memory=budget, max_num_seqs=4)
        prompts = self._random_prompts(tuple(min(n, max_len - NEW_TOKENS) for n in (9, 11, 13, 10)), seed=4)
        outputs = self._generate(llm, prompts)
        preemptions = llm.memory_stats()["num_preemptions"]
        expect(preemptions > 0, f"preemption: {len(prompts)} prompts in a KV cache of {llm.runner.num_blocks} blocks "
                                "ran without a preemption (the check could not force one)")
        self._expect_greedy(f"preemption ({preemptions} preemptions)", prompts, outputs)
        return f"{preemptions} preemption(s)"

    def check_attention_backend(self, backend: str) -> None:
        """The prompts with ``attention_backend=backend`` and prefill chunks of :data:`CHUNK_TOKENS`:
        transformers' greedy tokens, and every attention layer uses that backend."""
        from modelrunner.api import Attention

        self._require_device()
        if self.capabilities.get("attention_backends") is False:
            raise NotApplicable(f"{self.plugin!r} declares that {self.name} runs its own attention, not attention "
                                "backends")
        self._require_paged(self.batched, "it runs no paged-attention backend")
        cls = self.plugins.attention_backend_class(backend)
        if self._sliding_window() and not cls.supports_sliding_window:
            raise NotApplicable(f"attention backend {backend!r} declares no sliding-window support and "
                                f"{self.architecture} has a window")
        llm = self.llm(f"attention={backend}", attention_backend=backend, max_num_batched_tokens=CHUNK_TOKENS,
                       max_num_seqs=len(PROMPT_LENGTHS))
        layers = [m for m in llm.runner.loaded.model.modules() if isinstance(m, Attention)]
        others = sorted({getattr(type(m.backend), "name", "?") for m in layers} - {backend})
        expect(not others, f"attention_backend={backend!r} was asked for, but the model's attention layers run "
                           f"{', '.join(others)}")
        outputs = self._generate(llm, self.prompts)
        self._expect_greedy(f"attention backend {backend!r}", self.prompts, outputs)

    def check_tensor_parallel(self) -> str:
        """With ``tensor_parallel_size=2`` (a worker process): transformers' greedy tokens for the prompts
        (prefill chunks of :data:`CHUNK_TOKENS`), and one prompt's logits within :data:`TP_LOGITS_ATOL`.
        Returns the largest logit difference."""
        from modelrunner.api import Plugins
        from modelrunner.plugins import get_plugins  # kernel internal: the process's loaded plugins

        self._require_device()
        if not self.tensor_parallel:
            raise NotApplicable("left out by the suite's options (tensor_parallel=False)")
        if self._device_type == "cuda":
            import torch

            if torch.cuda.device_count() < 2:
                raise NotApplicable(f"two ranks on CUDA need two GPUs; this machine has {torch.cuda.device_count()}")
        declared = self.capabilities.get("tensor_parallel")
        if declared is not True:
            raise NotApplicable(f"{self.plugin!r} does not declare tensor_parallel=True for {self.name} "
                                f"(declared {declared!r})")
        # Parallel ranks route through the process's own plugins (rank 0) and the entry points a fresh
        # interpreter finds (the workers), not through ``self.plugins``.
        views = {"rank 0": get_plugins(),
                 "a worker": Plugins(allow=_env_names(_ALLOW_ENV), block=_env_names(_BLOCK_ENV) or [])}
        for rank, view in views.items():
            problem = self._routing_problem(view, self.architecture)
            if problem is not None:
                raise NotApplicable(f"tensor-parallel {rank} would not run plugin {self.plugin!r} (parallel ranks "
                                    f"load the installed plugins, not the ones passed to the suite): {problem}")
        llm = make_llm(self.checkpoint, self.plugins,
                       **self.llm_config(tensor_parallel_size=2, max_num_batched_tokens=CHUNK_TOKENS,
                                         max_num_seqs=len(PROMPT_LENGTHS)))
        try:
            ranks = llm.runner.ranks
            for rank in ranks:
                expect(self.plugin in rank.get("plugins", []),
                       f"tensor-parallel rank {rank.get('rank')} did not load plugin {self.plugin!r}")
            outputs = self._generate(llm, self.prompts)
            self._expect_greedy("tensor_parallel_size=2", self.prompts, outputs)
            prompt = self.prompts[-1]
            got = llm.runner.forward(prompt)[0].cpu()
            want = reference_logits(self.reference, prompt)
            expect(tuple(got.shape) == tuple(want.shape),
                   f"tensor_parallel_size=2: logits of shape {list(got.shape)}, transformers' {list(want.shape)}")
            diff = (got - want).abs().max().item()
            expect(diff <= TP_LOGITS_ATOL,
                   f"tensor_parallel_size=2: logits of a {len(prompt)}-token prompt differ from transformers' by "
                   f"{diff:.3g}, tolerance {TP_LOGITS_ATOL:g}")
            return f"max |logits difference| {diff:.3g} (tolerance {TP_LOGITS_ATOL:g})"
        finally:
            llm.shutdown()


__all__ = [
    "BLOCK_SIZE",
    "GENERIC_ARCHITECTURES",
    "KV_CACHE_MEMORY",
    "LOGITS_ATOL",
    "NEW_TOKENS",
    "PROMPT_LENGTHS",
    "TP_LOGITS_ATOL",
    "AdapterSuite",
]
