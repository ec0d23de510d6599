"""The prompts a benchmark runs: seeded synthetic ones of an exact token length, or a JSONL dataset.

A workload is described by a :class:`WorkloadSpec` (plain values) and built in each process from
the model's tokenizer, so every configuration of a comparison gets the same token ids; the
:attr:`Workload.digest` lets the caller check that it did.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import attrs

WORDS = (
    "river mountain engine garden science history music ocean window letter market planet winter "
    "teacher forest bridge language city dragon number machine coffee village island storm castle "
    "kitchen library harbor painting question journey lantern orchard theory violin desert meadow "
    "signal station compass silver thunder candle mirror feather canyon puzzle festival"
).split()
"""Plain English words synthetic prompts are made of (real text tokenizes like real prompts do)."""


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@attrs.frozen
class WorkloadSpec:
    """What to run, in plain values (it travels to worker processes as JSON)."""

    num_prompts: int | None = attrs.field(default=None, validator=_optional_positive)
    """Prompts to run (the latency batch size); with a dataset, its first ``num_prompts`` (None: all)."""
    input_len: int | None = attrs.field(default=32, validator=_optional_positive)
    """Tokens per synthetic prompt (None with a dataset)."""
    output_len: int = attrs.field(default=32, validator=_positive)
    """New tokens per prompt (a dataset line's ``output_len`` wins)."""
    dataset: str | None = None
    """A JSONL file of prompts instead of synthetic ones."""
    seed: int = 0
    """Seed of the synthetic prompts."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``WorkloadSpec(**d)`` rebuilds it)."""
        return attrs.asdict(self)


@attrs.frozen
class Workload:
    """Token-id prompts and how many tokens to generate for each."""

    prompts: list[list[int]]
    """Every prompt's token ids."""
    output_lens: list[int]
    """New tokens per prompt."""
    source: str
    """``synthetic`` or the dataset's path."""
    constraints: list[dict[str, Any] | None] | None = None
    """Per prompt, the ``structured_outputs`` fields of its dataset line (None: unconstrained)."""
    loras: list[str | None] | None = None
    """Per prompt, the LoRA adapter (PEFT directory) of its dataset line (None: the base model)."""

    @property
    def digest(self) -> str:
        """A hash of the prompts, output lengths, constraints and adapters: equal digests mean the same work."""
        parts: list[Any] = [self.prompts, self.output_lens]
        if self.constraints is not None and any(self.constraints):
            parts.append(self.constraints)
        if self.loras is not None and any(self.loras):
            parts.append(self.loras)
        blob = json.dumps(parts, separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def sampling_params(self) -> list[Any]:
        """Greedy parameters per prompt. An unconstrained prompt ignores EOS, so every run does the same
        work; a constrained one ends where its grammar does (or at its output length)."""
        from modelrunner import SamplingParams, StructuredOutputsParams

        constraints = self.constraints or [None] * len(self.prompts)
        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=c is None,
                               structured_outputs=None if c is None else StructuredOutputsParams(**c))
                for n, c in zip(self.output_lens, constraints)]

    def lora_requests(self) -> list[Any] | None:
        """Per prompt, a :class:`~modelrunner.lora.LoRARequest` of its adapter (ids by first appearance,
        named by path) or None; None when no prompt names one."""
        if not self.loras or not any(self.loras):
            return None
        from modelrunner import LoRARequest

        ids: dict[str, int] = {}
        for path in self.loras:
            if path is not None and path not in ids:
                ids[path] = len(ids) + 1
        return [None if path is None else LoRARequest(path, ids[path], path) for path in self.loras]

    def describe(self) -> dict[str, Any]:
        """Sizes and the digest, for reports."""
        lens = [len(p) for p in self.prompts]
        return {"source": self.source, "num_prompts": len(self.prompts), "prompt_tokens": sum(lens),
                "min_prompt_len": min(lens), "max_prompt_len": max(lens), "output_tokens": sum(self.output_lens),
                "constrained_prompts": sum(1 for c in self.constraints or [] if c is not None),
                "lora_prompts": sum(1 for path in self.loras or [] if path is not None),
                "lora_adapters": len({path for path in self.loras or [] if path is not None}), "digest": self.digest}


def synthetic_prompts(count: int, input_len: int, seed: int, tokenizer: Any = None,
                      vocab_size: int | None = None) -> list[list[int]]:
    """``count`` different prompts of exactly ``input_len`` tokens, the same for the same arguments.

    With a tokenizer, seeded random English words are tokenized and cut to length; without one,
    seeded random token ids below ``vocab_size`` are drawn.
    """
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        if tokenizer is None:
            if not vocab_size:
                raise ValueError("synthetic prompts need a tokenizer or a vocabulary size")
            prompts.append([rng.randrange(vocab_size) for _ in range(input_len)])
            continue
        words: list[str] = []
        ids: list[int] = []
        while len(ids) < input_len:
            words += [rng.choice(WORDS) for _ in range(max(8, input_len))]
            ids = list(tokenizer.encode(" ".join(words)))
        prompts.append(ids[:input_len])
    return prompts


def read_dataset(path: str | Path) -> list[dict[str, Any]]:
    """The lines of a JSONL dataset: each an object with ``prompt`` (text) or ``prompt_token_ids``
    (a list of ints), and optionally ``output_len`` (a positive int), ``structured_outputs`` (the
    fields of :class:`~modelrunner.sampling_params.StructuredOutputsParams`, such as
    ``{"json": {...schema...}}``, to constrain that prompt's output) and ``lora`` (a PEFT adapter's
    directory that prompt runs with; the configuration needs ``enable_lora``). Blank lines are skipped.

    :raises ValueError: naming the file and line of the first malformed entry, or an empty file.
    :raises OSError: the file cannot be read.
    """
    path = Path(path)
    entries = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"--dataset {path}, line {number}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(entry, dict):
                raise ValueError(f"{where}: expected an object like {{\"prompt\": \"...\"}}, got {type(entry).__name__}")
            if "prompt_token_ids" in entry:
                ids = entry["prompt_token_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                   and t >= 0 for t in ids):
                    raise ValueError(f"{where}: prompt_token_ids must be a non-empty list of token ids")
            elif not isinstance(entry.get("prompt"), str) or not entry["prompt"]:
                raise ValueError(f"{where}: needs a non-empty 'prompt' string or 'prompt_token_ids' "
                                 f"(keys: {sorted(entry)})")
            out = entry.get("output_len")
            if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out <= 0):
                raise ValueError(f"{where}: output_len must be a positive integer, got {out!r}")
            if entry.get("structured_outputs") is not None:
                _check_constraint(entry["structured_outputs"], where)
            lora = entry.get("lora")
            if lora is not None and (not isinstance(lora, str) or not lora):
                raise ValueError(f"{where}: lora must be a LoRA adapter's directory (a non-empty string), got {lora!r}")
            entries.append(entry)
    if not entries:
        raise ValueError(f"--dataset {path}: no prompts in the file")
    return entries


def _check_constraint(value: Any, where: str) -> None:
    """:raises ValueError: ``value`` is not a valid set of StructuredOutputsParams fields."""
    # Validates a constraint as SamplingParams would (internal: modelrunner.sampling.structured).
    from modelrunner.sampling.structured import as_structured_outputs

    if not isinstance(value, dict):
        raise ValueError(f"{where}: structured_outputs must be an object such as {{\"json\": {{...}}}}, "
                         f"got {type(value).__name__}")
    try:
        as_structured_outputs(dict(value))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: structured_outputs: {e}") from None


def build_workload(spec: WorkloadSpec, tokenizer: Any = None, vocab_size: int | None = None) -> Workload:
    """The prompts ``spec`` describes, as token ids of this model's tokenizer.

    :raises ValueError: a malformed dataset, or text prompts for a model without a tokenizer.
    """
    if spec.dataset is None:
        if spec.input_len is None:
            raise ValueError("synthetic prompts need input_len")
        count = spec.num_prompts or 1
        prompts = synthetic_prompts(count, spec.input_len, spec.seed, tokenizer, vocab_size)
        return Workload(prompts, [spec.output_len] * count, "synthetic")
    entries = read_dataset(spec.dataset)[:spec.num_prompts]
    prompts = []
    for number, entry in enumerate(entries):
        if "prompt_token_ids" in entry:
            prompts.append(list(entry["prompt_token_ids"]))
        elif tokenizer is None:
            raise ValueError(f"--dataset {spec.dataset}: entry {number} is text, but this model has no tokenizer; "
                             "give prompt_token_ids instead")
        else:
            prompts.append(list(tokenizer.encode(entry["prompt"])))  # as the engine tokenizes text prompts
    output_lens = [entry.get("output_len") or spec.output_len for entry in entries]
    constraints = [entry.get("structured_outputs") for entry in entries]
    loras = [entry.get("lora") for entry in entries]
    return Workload(prompts, output_lens, str(spec.dataset), constraints if any(constraints) else None,
                    loras if any(loras) else None)
