"""The files ``modelrunner new-plugin`` writes, per kind: a distribution that installs, lists in
``modelrunner plugins`` and passes its own conformance test before its author changes a line."""

from __future__ import annotations

KINDS = {
    "adapter": "architectures",
    "attention-backend": "attention_backends",
    "allocator": "allocators",
    "compile-backend": "compile_backends",
    "quantization-method": "quantization_methods",
    "logits-processor": "logits_processors",
    "matmul-kernel": "matmul_kernels",
    "grammar-backend": "grammar_backends",
    "tool-parser": "tool_parsers",
    "proposer": "proposers",
    "lora-kernel": "lora_kernels",
    "executor": "executors",
    "pooling": "pooling_methods",
}
"""``new-plugin`` KIND → the registry kind its conformance suite checks."""

DEPENDENCIES = {"quantization-method": ("modelrunner", "modelrunner-quantization")}
"""``new-plugin`` KIND → the distributions its skeleton requires (default: the kernel alone)."""

PYPROJECT = '''\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "{summary}"
readme = "README.md"
requires-python = ">=3.10"
dependencies = [{dependencies}]

[project.optional-dependencies]
# The conformance suites live in modelrunner-kit (modelrunner_kit.conformance).
test = ["modelrunner-kit", "pytest>=8", "hypothesis>=6"]

# How modelrunner finds the plugin: the entry point names it, its value is the module with the hooks.
[project.entry-points.modelrunner]
{entry} = "{module}"

[tool.setuptools]
packages = ["{module}"]
'''

README = '''\
# {dist}

{summary}

```sh
pip install -e '.[test]'         # the plugin, and modelrunner-kit for its tests; `modelrunner plugins` lists `{entry}`
pytest tests                     # the conformance suite of its kind
modelrunner check {entry}        # the same suite, from the command line (also modelrunner-kit)
```

{usage}
'''

TEST = '''\
"""The conformance suite modelrunner ships for this kind, run on this plugin's `{name}`."""

{imports}from modelrunner_kit.conformance import suite

test_conformance = suite("{kind}", "{name}"{options}).as_pytest()
'''

HEADER = '''\
"""{summary}"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

PLUGIN_API = ">=1.1,<2"
"""The modelrunner plugin API versions this plugin was written for (outside them it is listed as broken)."""
'''

MODULES = {
    "attention-backend": HEADER + '''
import torch

from modelrunner.api import TorchSDPABackend


class {cls}(TorchSDPABackend):
    """Paged attention; starts as the kernel's ``torch_sdpa`` (override ``build_metadata`` / ``forward``).

    Its class attributes are its declared capabilities: the configuration is refused up front where
    they exclude the model or the cache layout.
    """

    name = "{name}"
    priority = -10  # below the kernel's backends: used only when asked for (attention_backend="{name}")
    max_block_size = None  # largest KV block size it handles (None: any)
    supports_sliding_window = True
    dtypes = (torch.float32, torch.float16, torch.bfloat16)


@hookimpl
def register(registry: Any) -> None:
    """Declare the backend."""
    registry.attention_backends({cls})
''',
    "allocator": HEADER + '''
from modelrunner.api import PagedBlockAllocator


class {cls}(PagedBlockAllocator):
    """A KV-cache block allocator; starts as the kernel's ``paged`` one (override what you change)."""

    name = "{name}"
    supports_prefix_caching = True


@hookimpl
def register(registry: Any) -> None:
    """Declare the allocator and whether it caches prompt prefixes."""
    registry.allocators({cls}.name, prefix_caching={cls}.supports_prefix_caching)


@hookimpl
def allocate(num_blocks: int, block_size: int, max_model_len: int, config: Any) -> {cls}:
    """A fresh allocator (called only for ``kv_allocator="{name}"``)."""
    return {cls}(num_blocks, block_size, max_model_len, enable_prefix_caching=config.enable_prefix_caching)
''',
    "compile-backend": HEADER + '''

@hookimpl
def register(registry: Any) -> None:
    """Declare the backend and where it runs."""
    registry.compile_backends("{name}", devices=("cpu", "cuda"), tensor_parallel=True, pipeline_parallel=True)


@hookimpl
def compile(name: str, loaded: Any, config: Any) -> Any:
    """The callable run in place of the model: here the eager one, wrapped (replace with your compiler).

    ``loaded.runnable`` is the kernel's eager callable (the plain model), with the
    model's signature ``(batch, kv_caches, **inputs)``; ``config.options`` are ``compile_options``.
    """
    inner = loaded.runnable

    def run(batch: Any, kv_caches: Any, **inputs: Any) -> Any:
        return inner(batch, kv_caches, **inputs)

    return run
''',
    "quantization-method": HEADER + '''
from modelrunner_quantization import Int8Method


class {cls}(Int8Method):
    """A weight quantization method; starts as modelrunner-quantization's ``int8`` (per-channel int8 weights
    quantized at load). Override ``prepare`` (give the layers storage on the meta device) and
    ``process_after_loading``, or ``_scheme`` (the storage format each layer gets).
    """

    name = "{name}"
    conformance_tolerance = 0.05  # max |logits - float logits| / max |float logits| on a tiny model


@hookimpl
def register(registry: Any) -> None:
    """Declare the method (config ``quantization="{name}"``)."""
    registry.quantization_methods({cls})
''',
    "logits-processor": HEADER + '''
from collections.abc import Sequence

import torch

from modelrunner.api import LogitsProcessor, LogitsRow, banned_mask


class {cls}(LogitsProcessor):
    """Bans the token ids a request lists: ``SamplingParams(logits_processors=[("{name}", {{"token_ids": [7]}})])``."""

    name = "{name}"
    example_args = ({{"token_ids": [0, 1]}},)  # what the conformance suite runs a request with

    def request_state(self, params: Any, args: dict[str, Any]) -> list[int]:
        """Check the request's arguments once, when it is added (a ValueError rejects the request)."""
        unknown = set(args) - {{"token_ids"}}
        if unknown:
            raise ValueError(f"{name} takes 'token_ids', got {{sorted(unknown)}}")
        ids = args.get("token_ids", [])
        vocab = self.context.vocab_size
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"{name}: token_ids must be a list of ids in [0, {{vocab}}), got {{ids!r}}")
        return list(ids)

    def apply(self, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
        """Every listed id of each row to -inf, in one masked fill for the whole step."""
        mask = banned_mask(len(rows), logits.shape[-1], [row.state for row in rows], logits.device)
        return logits.masked_fill_(mask, float("-inf"))


@hookimpl
def register(registry: Any) -> None:
    """Declare the processor."""
    registry.logits_processors({cls})
''',
    "adapter": HEADER + '''
import torch

from modelrunner.api import DecoderForCausalLM, LoadedModel, build_and_load, check_built_for, loaded_for, run_stage

ARCHITECTURE = "{arch}"
"""The ``architectures`` entry of the checkpoints this adapter loads
({arch_note})."""


class {arch}(DecoderForCausalLM):
    """The model, built from the kernel's layers (so tensor parallelism and quantization apply): the
    pre-norm Llama decoder. Override ``make_attention`` / ``make_mlp`` / ``attention_biases`` for your
    architecture."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the architecture and what the adapter supports."""
    registry.architectures(ARCHITECTURE, tensor_parallel=True, pipeline_parallel=True, quantization=("*",),
                           devices=("cpu", "cuda"){model_type})


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype, parallel: Any,
         attention_backend: Any, max_model_len: int) -> LoadedModel:
    """Build the model on the meta device, then stream this rank's weights in."""
    def build() -> {arch}:
        return {arch}(source.hf_config, max_model_len, parallel, attention_backend)

    model = build_and_load(build, source, device, dtype)
    return loaded_for(model, source, config, dtype)


@hookimpl
def forward(loaded: LoadedModel, batch: Any, kv_caches: list[torch.Tensor]) -> Any:
    """Logits for the rows ``batch.logits_indices`` of the step's flattened tokens."""
    return run_stage(loaded, batch, kv_caches)


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> None:
    """The split happened while building; check it matches this rank."""
    check_built_for(loaded.model, parallel)
''',
    "matmul-kernel": HEADER + '''
import torch
import torch.nn.functional as F

from modelrunner.api import MatmulKernel, QuantizedWeight, WeightFormat, dequantize_planar


class {cls}(MatmulKernel):
    """A matmul kernel for quantized weights; starts as the kernel's ``reference`` (dequantize, then
    ``F.linear``). Replace ``run`` (and ``bind``, for work done once per weight) with your kernel.

    Its class attributes are its declared capabilities: where it runs, the storage layout it reads,
    whether activations stay float.
    """

    name = "{name}"
    devices = ("cpu",)
    layout = "planar"  # the storage it reads (another layout: also implement pack / unpack)
    exact = True  # float activations: the float matmul up to summation order
    timed = False  # True: timed against the other kernels for every quantized layer; False: only kernel="{name}"

    @classmethod
    def supports(cls, format: WeightFormat, device: torch.device | str) -> bool:
        """The formats it claims: planar 4-bit and 8-bit weights, any group size, on the CPU."""
        return format.bits in (4, 8) and torch.device(device).type in cls.devices

    def run(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x`` (float32 ``[M, cols]``, contiguous) times the weight: float32 ``[M, rows]``."""
        w = dequantize_planar(*weight.storage, weight.format.group_size, weight.format.bits)
        return F.linear(x, w)


@hookimpl
def register(registry: Any) -> None:
    """Declare the kernel (quantization option ``kernel="{name}"`` pins it)."""
    registry.matmul_kernels({cls})
''',
    "grammar-backend": HEADER + '''
from collections.abc import Sequence

import torch

from modelrunner.api import GrammarBackend, GrammarMatcher, GrammarSpec, bitmask_from_allowed, decoded_vocabulary


class {cls}Grammar:
    """One compiled ``choice`` constraint: every prefix of a choice is a state, with its token mask."""

    def __init__(self, choices: list[str], masks: dict[str, torch.Tensor]) -> None:
        self.choices = set(choices)
        self.masks = masks  # state (text so far) -> int32 bitmask row of the tokens allowed next


class {cls}Matcher(GrammarMatcher):
    """Where one sequence is: the stack of states it went through (so rollback is a pop)."""

    def __init__(self, grammar: {cls}Grammar, vocabulary: list[str | None], eos: frozenset[int]) -> None:
        self.grammar, self.vocabulary, self.eos = grammar, vocabulary, eos
        self.states: list[tuple[str, bool]] = [("", False)]  # (text so far, ended by EOS)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The whole row: the precomputed mask of the current state."""
        text, ended = self.states[-1]
        bitmask[row] = 0 if ended else self.grammar.masks[text]

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Follow each token's text; EOS only after a complete choice."""
        for token in tokens:
            text, ended = self.states[-1]
            if ended:
                return False
            if token in self.eos:
                if text not in self.grammar.choices:
                    return False
                self.states.append((text, True))
                continue
            piece = self.vocabulary[token] if 0 <= token < len(self.vocabulary) else None
            if piece is None or text + piece not in self.grammar.masks:
                return False
            self.states.append((text + piece, False))
        return True

    def rollback(self, num_tokens: int) -> None:
        """Pop the last states."""
        del self.states[len(self.states) - num_tokens:]

    def is_terminated(self) -> bool:
        """Ended by EOS (a choice that is a prefix of another may go on)."""
        return self.states[-1][1]


class {cls}(GrammarBackend):
    """A grammar backend for ``choice`` constraints, in pure Python: the output is one of a list of
    strings. Replace ``compile`` / ``matcher`` with a grammar library's to add kinds (and list them in
    ``constraints``); ``check`` refuses, when a request is added, what ``compile`` could not honour.
    """

    name = "{name}"
    constraints = ("choice",)  # the kinds it compiles: json, json_object, regex, choice, grammar
    auto_order = None  # None: used only when named; a number: tried by backend="auto" (xgrammar 10, guidance 20)

    def check(self, spec: GrammarSpec) -> None:
        """Refuse undeclared kinds (the base class) and choices longer than 1000 characters."""
        super().check(spec)
        if sum(len(c) for c in spec.choices) > 1000:
            raise self.unsupported(spec, "choices of more than 1000 characters in all")

    def compile(self, spec: GrammarSpec) -> {cls}Grammar:
        """For every prefix of every choice, the tokens whose text continues it (EOS where a choice ends).
        Runs in a worker thread; the engine caches the result per distinct choice list."""
        vocabulary = decoded_vocabulary(self.context)  # per token id its text; None: special or padding
        choices = spec.choices
        allowed: dict[str, set[int]] = {{c[:i]: set() for c in choices for i in range(len(c) + 1)}}
        for token, piece in enumerate(vocabulary):
            if not piece:
                continue
            for choice in choices:
                for start in range(len(choice)):
                    if choice.startswith(piece, start):
                        allowed[choice[:start]].add(token)
        for choice in choices:
            allowed[choice] |= self.context.eos_token_ids
        masks = {{text: bitmask_from_allowed(sorted(ids), self.context.vocab_size) for text, ids in allowed.items()}}
        return {cls}Grammar(choices, masks)

    def matcher(self, compiled: {cls}Grammar) -> {cls}Matcher:
        """A matcher at the start (one per sequence)."""
        return {cls}Matcher(compiled, decoded_vocabulary(self.context), self.context.eos_token_ids)


@hookimpl
def register(registry: Any) -> None:
    """Declare the backend (``structured_outputs_config={{"backend": "{name}"}}`` picks it)."""
    registry.grammar_backends({cls})
''',
    "tool-parser": HEADER + '''
import json
from collections.abc import Sequence

from modelrunner.api import ParsedOutput, ToolCall, ToolParser, json_values


class {cls}(ToolParser):
    """Tool calls written as ``<call>{{"name": ..., "arguments": {{...}}}}</call>``, text around them as
    content. Change ``OPEN`` / ``CLOSE`` (and ``parse`` / ``format``) to your model family's format.

    Its class attributes are what the server relies on while streaming: text up to the first start
    marker is sent as content, the rest is held until the output is finished and parsed.
    """

    name = "{name}"
    OPEN, CLOSE = "<call>", "</call>"
    start_markers = (OPEN,)

    def parse(self, text: str) -> ParsedOutput:
        """Content and calls of a finished output; a block that is not a call stays content."""
        calls, content, at = [], [], 0
        while (start := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, start)
            stop = end + len(self.CLOSE) if end >= 0 else len(text)
            values = json_values(text[start + len(self.OPEN): end if end >= 0 else len(text)])
            found = [ToolCall.of(v.get("name"), v.get("arguments")) if isinstance(v, dict) else None
                     for v in values or []]
            if found and all(found):
                content.append(text[at:start])
                calls.extend(found)
            else:
                content.append(text[at:stop])
            at = stop
        content.append(text[at:])
        return ParsedOutput("".join(content).strip() or None, tuple(calls))

    def format(self, calls: Sequence[ToolCall]) -> str:
        """How the model writes ``calls``: one block each."""
        return "".join(f"{{self.OPEN}}{{json.dumps({{'name': c.name, 'arguments': json.loads(c.arguments)}})}}"
                       f"{{self.CLOSE}}" for c in calls)


@hookimpl
def register(registry: Any) -> None:
    """Declare the parser (``modelrunner serve ... --enable-auto-tool-choice --tool-call-parser {name}``)."""
    registry.tool_parsers({cls})
''',
    "proposer": HEADER + '''
from collections.abc import Sequence

from modelrunner.api import ProposalRequest, Proposer, ProposerContext


class {cls}(Proposer):
    """Proposes what followed the previous occurrence of the sequence's last token (prompt lookup on one
    token). Replace :meth:`propose` with your guess of what follows each sequence: the engine checks
    every proposed token with the target model, so a bad guess costs speed, never correctness (and
    ``modelrunner check`` measures how many of your guesses are accepted on text that copies its prompt).

    The settings come from ``speculative_config`` (``self.context.config``: ``num_speculative_tokens``,
    ``prompt_lookup_min`` / ``prompt_lookup_max``, ``model``); ``self.context.vocab_size`` bounds the ids.
    """

    name = "{name}"

    def __init__(self, context: ProposerContext) -> None:
        super().__init__(context)

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """At most ``request.num_tokens`` token ids per request, in order (``[]``: no guess)."""
        proposals = []
        for request in requests:
            tokens = request.token_ids
            earlier = [i for i in range(len(tokens) - 1) if tokens[i] == tokens[-1]]
            # The tokens after the latest earlier occurrence: the ones that follow it, not the one itself.
            proposals.append(list(tokens[earlier[-1] + 1:earlier[-1] + 1 + request.num_tokens]) if earlier else [])
        return proposals

    def forget(self, seq_ids: Sequence[int]) -> None:
        """Sequences that ended or were preempted (drop state kept per sequence; none here)."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the proposer (``LLM(model, speculative_config={{"method": "{name}"}})`` picks it)."""
    registry.proposers({cls})
''',
    "lora-kernel": HEADER + '''
import torch

from modelrunner.api import LoRAKernel, LoRAMapping


class {cls}(LoRAKernel):
    """Adds each token's LoRA delta with one batched gather: every token's A and B are taken from its
    slot and multiplied with ``torch.bmm`` (base-model tokens are masked out). Replace ``apply`` with
    your kernel (a fused shrink/expand, a segment matmul on GPU ...)."""

    name = "{name}"
    devices = None  # or ("cuda",): the device types it runs on

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              mapping: LoRAMapping) -> torch.Tensor:
        """``y`` plus ``lora_b[s] @ (lora_a[s] @ x[t])`` for every token ``t`` of slot ``s >= 0``."""
        slots = mapping.token_slots
        used = slots >= 0
        index = slots.clamp(min=0)
        shrunk = torch.bmm(lora_a.index_select(0, index), x.unsqueeze(2))  # [tokens, rank, 1]
        delta = torch.bmm(lora_b.index_select(0, index), shrunk).squeeze(2)  # [tokens, out]
        return y + delta * used.unsqueeze(1).to(delta.dtype)


@hookimpl
def register(registry: Any) -> None:
    """Declare the kernel (``LLM(model, enable_lora=True, lora_kernel="{name}")`` picks it)."""
    registry.lora_kernels({cls})
''',
    "executor": HEADER + '''
import time

from modelrunner.api import UniprocExecutor


class {cls}(UniprocExecutor):
    """Runs the model in this process, as the kernel's ``uni`` executor does, and times every step.

    To run the ranks elsewhere (a cluster's actors, remote machines), override ``create`` (build what
    the configuration needs: processes, a group) and ``load_model`` / ``execute_model`` /
    ``copy_blocks`` / ``shutdown`` / ``check_health``; set ``parallel = True`` once it runs
    ``tensor_parallel_size`` x ``pipeline_parallel_size`` > 1.
    """

    name = "{name}"
    parallel = False  # one process: a configuration of several ranks is refused up front
    launched_externally = False

    def __init__(self, config: Any = None, plugins: Any = None, runner: Any = None) -> None:
        super().__init__(config, plugins, runner)
        self.step_seconds: list[float] = []

    def execute_model(self, batch: Any) -> Any:
        """One step in this process, timed."""
        started = time.perf_counter()
        out = super().execute_model(batch)
        self.step_seconds.append(time.perf_counter() - started)
        return out

    def stats(self) -> dict[str, Any]:
        """The runner's statistics, plus this executor's step count and mean step time."""
        out = super().stats()
        steps = self.step_seconds
        out["{name}"] = {{"steps": len(steps), "mean_step_s": sum(steps) / len(steps) if steps else 0.0}}
        return out


@hookimpl
def register(registry: Any) -> None:
    """Declare the executor (``LLM(model, distributed_executor_backend="{name}")`` picks it)."""
    registry.executors({cls})
''',
    "pooling": HEADER + '''
from collections.abc import Sequence

import torch

from modelrunner.api import PoolingMethod


class {cls}(PoolingMethod):
    """Max pooling: each dimension's largest value over the prompt's tokens (sentence-transformers'
    ``pooling_mode_max_tokens``). Replace :meth:`pool` with your method; set ``reads`` to ``"first"`` or
    ``"last"`` when it needs that token's hidden state only (the engine then keeps no other row, and
    with ``"last"`` prompts share cached prefixes).
    """

    name = "{name}"
    reads = "all"  # which rows pool() gets: "all" (every prompt token's, in order), "first" or "last"

    def pool(self, hidden: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """``[tokens, hidden_size]`` float32 → ``[hidden_size]``: the maximum over the tokens (the kernel
        then truncates to the request's ``dimensions`` and L2-normalises)."""
        return hidden.amax(dim=0)


@hookimpl
def register(registry: Any) -> None:
    """Declare the method (``LLM(model, pooling_type="{name}")`` picks it)."""
    registry.pooling_methods({cls})
''',
}
"""KIND → the plugin module (``{name}``, ``{cls}`` filled in; an adapter's ``{arch}`` too)."""

ADAPTER_TRANSFORMERS = HEADER + """
import torch

from modelrunner.api import LoadedModel, transformers_adapter

ARCHITECTURE = "{arch}"
\"\"\"The ``architectures`` entry of the checkpoints this adapter loads (transformers' model_type ``{model_type}``).\"\"\"


@hookimpl
def register(registry: Any) -> None:
    \"\"\"Declare the architecture. It starts as transformers' own model (correct, one sequence at a time,
    its own KV cache): build it from modelrunner's layers (``modelrunner.models.DecoderForCausalLM``) to
    get the paged KV cache, attention backends, tensor parallelism and quantization, and declare them.\"\"\"
    registry.architectures(ARCHITECTURE, tensor_parallel=False, pipeline_parallel=False, quantization=("none",),
                           devices=("cpu", "cuda"), attention_backends=False)


@hookimpl
def load(source: Any, config: Any, device: torch.device, dtype: torch.dtype) -> LoadedModel | None:
    \"\"\"transformers' model for the checkpoint.\"\"\"
    return transformers_adapter.load(source, config, device, dtype)


@hookimpl
def forward(loaded: LoadedModel, batch: Any) -> torch.Tensor:
    \"\"\"Logits for the rows ``batch.logits_indices``, each sequence through transformers' own cache.\"\"\"
    return transformers_adapter.forward(loaded, batch)


@hookimpl
def parallelize(loaded: LoadedModel, parallel: Any) -> None:
    \"\"\"Refuse more than one process (transformers' model has no split plan here).\"\"\"
    transformers_adapter.parallelize(loaded, parallel)
"""
"""The adapter module for a transformers family the kernel's Llama-shaped decoder does not run as is
(``new-plugin adapter gpt_neox``): it starts on transformers' own model, so it passes its check at once."""

LLAMA_SHAPED = ("llama", "mistral")
"""transformers model types the adapter skeleton's kernel-built decoder loads and runs as they are."""

SUMMARIES = {
    "adapter": "A modelrunner model adapter for {arch} checkpoints.",
    "attention-backend": "The {name} paged-attention backend for modelrunner.",
    "allocator": "The {name} KV-cache block allocator for modelrunner.",
    "compile-backend": "The {name} compile backend for modelrunner.",
    "quantization-method": "The {name} weight quantization method for modelrunner.",
    "logits-processor": "The {name} logits processor for modelrunner.",
    "matmul-kernel": "The {name} matmul kernel for quantized weights in modelrunner.",
    "grammar-backend": "The {name} grammar backend for structured outputs in modelrunner.",
    "tool-parser": "The {name} tool-call parser for modelrunner's server.",
    "proposer": "The {name} speculative-decoding proposer for modelrunner.",
    "lora-kernel": "The {name} batched LoRA kernel for modelrunner.",
    "executor": "The {name} executor for modelrunner (what runs a model's ranks).",
    "pooling": "The {name} pooling method for modelrunner's embeddings.",
}

USAGE = {
    "adapter": 'Checkpoints whose `config.json` says `"architectures": ["{arch}"]` load through it:\n'
               '`LLM("path/to/checkpoint")`.',
    "attention-backend": '`LLM(model, attention_backend="{name}")`.',
    "allocator": '`LLM(model, kv_allocator="{name}")`.',
    "compile-backend": '`LLM(model, compile=True, compile_backend="{name}")`.',
    "quantization-method": '`LLM(model, quantization="{name}")`.',
    "logits-processor": '`llm.generate(prompt, SamplingParams(logits_processors=[("{name}", {{"token_ids": [7]}})]))`.',
    "matmul-kernel": '`LLM(model, quantization="int4", quantization_options={{"kernel": "{name}"}})`; with `timed = True`\n'
                     'it is timed against the other registered kernels for every quantized layer.',
    "grammar-backend": '`LLM(model, structured_outputs_config={{"backend": "{name}"}})`, then\n'
                       '`llm.generate(prompt, SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))`.',
    "tool-parser": '`modelrunner serve MODEL --enable-auto-tool-choice --tool-call-parser {name}`: with\n'
                   '`tool_choice="auto"` the calls the model writes come back as `tool_calls`.',
    "proposer": '`LLM(model, speculative_config={{"method": "{name}", "num_speculative_tokens": 4}})`.',
    "lora-kernel": '`LLM(model, enable_lora=True, lora_kernel="{name}")`, then\n'
                   '`llm.generate(prompt, lora_request=LoRARequest("my-adapter", 1, "/path/to/peft/adapter"))`.',
    "executor": '`LLM(model, distributed_executor_backend="{name}")`, or\n'
                '`modelrunner serve MODEL --set distributed_executor_backend={name}`.',
    "pooling": '`LLM(model, pooling_type="{name}").embed(["some text"])`, or\n'
               '`modelrunner serve MODEL --set pooling_type={name}` and `POST /v1/embeddings`.',
}

TEST_OPTIONS: dict[str, tuple[str, str]] = {}
"""KIND → (imports, extra ``suite(...)`` arguments) of its test."""
