"""One configuration, loaded once, measured repetition by repetition (in this process or a worker)."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

import attrs

from .latency import measure_latency
from .throughput import measure_throughput
from .workload import Workload, WorkloadSpec, build_workload


@attrs.frozen
class Measure:
    """A kind of measurement: the function that runs it and the metric comparisons rank by."""

    name: str
    """``latency`` or ``throughput``."""
    run: Callable[[Any, Workload], tuple[dict[str, Any], list[list[int]]]]
    """``run(llm, workload) -> (metrics, generated token ids per prompt)``."""
    primary_metric: str
    """The metric a comparison's speed ratio is computed from."""
    higher_is_better: bool
    """Whether a larger ``primary_metric`` is faster."""


MEASURES: dict[str, Measure] = {
    "latency": Measure("latency", measure_latency, "latency_s", False),
    "throughput": Measure("throughput", measure_throughput, "output_tokens_per_s", True),
}
"""Every measurement ``bench`` and ``bench compare`` can run, by name."""


def get_measure(name: str) -> Measure:
    """The :class:`Measure` called ``name``.

    :raises ValueError: an unknown name (naming the known ones).
    """
    try:
        return MEASURES[name]
    except KeyError:
        raise ValueError(f"unknown measurement {name!r}; choose one of {', '.join(MEASURES)}") from None


@attrs.frozen
class BenchSpec:
    """Everything a process needs to set up one configuration, in plain values (JSON-ready)."""

    measure: str
    """A :data:`MEASURES` name."""
    model: str
    """``--model``."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """Flat config keys for ``LLM(model, **config)``."""
    workload: WorkloadSpec = attrs.field(factory=WorkloadSpec)
    """The prompts."""
    threads: int | None = None
    """``torch.set_num_threads`` for this process (None: torch's default)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form; :meth:`from_dict` reverses it."""
        return {"measure": self.measure, "model": self.model, "config": dict(self.config),
                "workload": self.workload.as_dict(), "threads": self.threads}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchSpec:
        """Rebuild from :meth:`as_dict`'s form."""
        return cls(measure=d["measure"], model=d["model"], config=dict(d.get("config") or {}),
                   workload=WorkloadSpec(**d.get("workload", {})), threads=d.get("threads"))


def outputs_digest(tokens: list[list[int]]) -> str:
    """A short hash of generated token ids (equal hashes: identical outputs)."""
    return hashlib.sha256(json.dumps(tokens, separators=(",", ":")).encode()).hexdigest()[:16]


def repetition_records(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-repetition raw numbers a report keeps: index, every metric, outputs digest, start time."""
    return [{"index": i, **s["metrics"], "outputs_digest": s["outputs_digest"], "started_at": s["started_at"]}
            for i, s in enumerate(samples)]


def resolved_choices(llm: Any) -> dict[str, Any]:
    """What the configuration turned into once loaded: the adapter, attention backend, compile
    backend, allocator, dtype, device, lengths, KV blocks and grammar backend actually in use."""
    from modelrunner.api import Attention

    engine = llm.engine
    executor = engine.executor
    runner = getattr(executor, "runner", None)
    loaded = executor.loaded
    model = getattr(loaded, "model", None)
    backends = sorted({m.backend.name for m in model.modules() if isinstance(m, Attention)}) \
        if hasattr(model, "modules") else []
    config = engine.config
    return {
        "adapter": getattr(loaded, "adapter", None),
        "attention_backend": backends[0] if len(backends) == 1 else backends or None,
        "compile_backend": getattr(runner, "compile_backend", config.compile.backend_name),
        "kv_allocator": config.cache.kv_allocator,
        "dtype": str(getattr(runner, "dtype", None)).removeprefix("torch."),
        "device": str(getattr(runner, "device", config.device)),
        "max_model_len": engine.max_model_len,
        "block_size": executor.block_size,
        "num_kv_blocks": executor.num_blocks,
        "structured_outputs_backend": config.structured_outputs.backend,
        "lora_kernel": config.lora.lora_kernel if config.lora.enable_lora else None,
    }


class BenchSession:
    """A configuration loaded once and measured as often as asked.

    :param spec: what to load and run.
    """

    def __init__(self, spec: BenchSpec) -> None:
        self.spec = spec
        """What this session runs."""
        self.measure = get_measure(spec.measure)
        """The kind of measurement."""
        self.llm: Any = None
        """The loaded ``LLM`` (None before :meth:`load`)."""
        self.workload: Workload | None = None
        """The prompts, built from the model's tokenizer by :meth:`load`."""

    def load(self) -> dict[str, Any]:
        """Load the model with the configuration and build the workload.

        :returns: ``load_s``, ``config`` (the full resolved configuration), ``resolved`` (see
            :func:`resolved_choices`), ``workload`` (its description), ``threads``, ``pid``.
        :raises ValueError: a bad configuration, or a prompt too long for ``max_model_len``.
        """
        import torch

        from modelrunner import LLM

        if self.spec.threads is not None:
            torch.set_num_threads(self.spec.threads)
        start = time.perf_counter()
        self.llm = LLM(self.spec.model, **self.spec.config)
        load_s = time.perf_counter() - start
        engine = self.llm.engine
        self.workload = build_workload(self.spec.workload, engine.tokenizer, engine.vocab_size)
        for i, (prompt, new) in enumerate(zip(self.workload.prompts, self.workload.output_lens)):
            if len(prompt) + new > engine.max_model_len:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens: with {new} new tokens it exceeds "
                                 f"max_model_len={engine.max_model_len}; shorten the prompts or outputs, or raise "
                                 "max_model_len")
        return {
            "load_s": load_s,
            "config": attrs.asdict(engine.config),
            "resolved": resolved_choices(self.llm),
            "workload": self.workload.describe(),
            "threads": torch.get_num_threads(),
            "pid": os.getpid(),
        }

    def run(self, keep_outputs: bool = False) -> dict[str, Any]:
        """One repetition, from an empty prefix cache (so a repetition never reuses the last one's KV).

        :returns: ``metrics``, ``outputs_digest``, ``started_at`` (wall-clock time, for checking how
            runs of several processes interleaved) and, with ``keep_outputs``, ``outputs`` (token ids
            per prompt).
        """
        if self.llm is None or self.workload is None:
            raise RuntimeError("BenchSession.run before load")
        self.llm.reset_prefix_cache()
        gc.collect()  # a collection inside the timed region would be noise
        started_at = time.time()
        metrics, tokens = self.measure.run(self.llm, self.workload)
        sample: dict[str, Any] = {"metrics": metrics, "outputs_digest": outputs_digest(tokens), "started_at": started_at}
        if keep_outputs:
            sample["outputs"] = tokens
        return sample

    def close(self) -> None:
        """Release the model (and any worker ranks it started)."""
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
