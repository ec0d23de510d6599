"""Structured outputs' cost, per grammar backend, on the default model (SmolLM2-135M-Instruct):

- throughput of a batch of 64 requests, each constrained by a JSON schema (8 schemas, each request
  its own, compiled before timing), against the same batch unconstrained, in alternating rounds in
  this process (target: at least 0.85x);
- compile time per schema, cold (a fresh backend, no cache), median and slowest of the schemas.

Both batches generate the same number of tokens per request (the schemas are open-ended arrays, so
no request stops early; the free batch ignores EOS).

    python bench/structured.py           # batch 64, 64 tokens, 3 rounds, both backends
    python bench/structured.py --quick   # batch 8, 8 tokens, 1 round: checks that it runs
    python bench/structured.py --compare # the backends side by side with `modelrunner bench compare`

``--compare`` writes the 64 constrained prompts as a JSONL dataset (a ``structured_outputs`` field
per line) and runs ``modelrunner bench compare --vary structured_outputs_backend=xgrammar,guidance``
on it: each backend in its own process, repetitions interleaved, speed with a confidence interval
and whether the greedy outputs agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from modelrunner import LLM, SamplingParams, StructuredOutputsParams
from modelrunner.structured_output import GrammarSpec

BACKENDS = ("xgrammar", "guidance")
"""The grammar backends the kernel ships."""


def schemas() -> list[dict]:
    """Eight open-ended schemas: arrays of records, so a request runs to ``max_tokens``."""
    fields = [("id", {"type": "integer"}), ("name", {"type": "string", "maxLength": 12}),
              ("ok", {"type": "boolean"}), ("score", {"type": "number", "minimum": 0, "maximum": 10}),
              ("kind", {"enum": ["a", "b", "c"]}), ("tags", {"type": "array", "items": {"type": "string"},
                                                              "maxItems": 3})]
    out = []
    for i in range(8):
        chosen = dict(fields[j % len(fields)] for j in range(i, i + 3))
        item = {"type": "object", "properties": chosen, "required": list(chosen), "additionalProperties": False}
        out.append({"type": "object", "properties": {f"records_{i}": {"type": "array", "items": item}},
                    "required": [f"records_{i}"], "additionalProperties": False})
    return out


def run_batch(llm: LLM, params: list[SamplingParams]) -> tuple[float, int]:
    """(seconds, output tokens) of one batch."""
    prompts = [[{"role": "user", "content": f"List records as JSON, number {i}."}] for i in range(len(params))]
    start = time.perf_counter()
    outs = llm.chat(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def compile_times(llm: LLM, backend: str) -> list[float]:
    """Seconds to compile each schema with a fresh ``backend`` (tokenizer state built first, untimed)."""
    engine = llm.engine
    cls = engine.executor.plugins.grammar_backend_class(backend)
    fresh = cls(engine.structured_outputs.context)
    fresh.compile(GrammarSpec.of(StructuredOutputsParams(json={"type": "integer"})))  # tokenizer info, once
    times = []
    for schema in schemas():
        spec = GrammarSpec.of(StructuredOutputsParams(json=schema))
        start = time.perf_counter()
        fresh.compile(spec)
        times.append(time.perf_counter() - start)
    return times


def measure(backend: str, batch: int, tokens: int, rounds: int) -> dict:
    """Throughputs, their ratio and compile times for one backend."""
    llm = LLM("smollm2", max_num_seqs=max(batch, 8), structured_outputs_config={"backend": backend})
    try:
        all_schemas = schemas()
        constrained = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                      structured_outputs=StructuredOutputsParams(json=all_schemas[i % 8]))
                       for i in range(batch)]
        free = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True) for _ in range(batch)]
        run_batch(llm, constrained[:8])  # compiles every schema; warms the model
        run_batch(llm, free[:8])
        rates: dict[str, list[float]] = {"constrained": [], "free": []}
        for _ in range(rounds):
            for name, params in (("constrained", constrained), ("free", free)):
                seconds, generated = run_batch(llm, params)
                rates[name].append(generated / seconds)
        compiled = compile_times(llm, backend)
    finally:
        llm.shutdown()
    c, f = statistics.median(rates["constrained"]), statistics.median(rates["free"])
    return {"backend": backend, "constrained": c, "free": f, "ratio": c / f,
            "compile_median_ms": 1000 * statistics.median(compiled), "compile_max_ms": 1000 * max(compiled)}


def write_dataset(path: Path, batch: int, tokens: int) -> None:
    """The constrained batch as a ``bench`` dataset: a prompt, its output length and its schema per line."""
    all_schemas = schemas()
    with path.open("w", encoding="utf-8") as f:
        for i in range(batch):
            f.write(json.dumps({"prompt": f"List records as JSON, number {i}.", "output_len": tokens,
                                "structured_outputs": {"json": all_schemas[i % 8]}}) + "\n")


def compare(batch: int, tokens: int, rounds: int) -> int:
    """``modelrunner bench compare`` over the grammar backends on the constrained dataset."""
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "json_schemas.jsonl"
        write_dataset(data, batch, tokens)
        return subprocess.call([sys.executable, "-m", "modelrunner.cli", "bench", "compare", "--dataset", str(data),
                                "--num-prompts", str(batch), "--repeat", str(max(rounds, 2)),
                                "--vary", f"structured_outputs_backend={','.join(BACKENDS)}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="batch 8, 8 tokens, 1 round (checks that it runs)")
    parser.add_argument("--backend", action="append", choices=BACKENDS, help="only these backends (repeatable)")
    parser.add_argument("--compare", action="store_true",
                        help="run the backends side by side with `modelrunner bench compare` instead")
    args = parser.parse_args()
    batch, tokens, rounds = (8, 8, 1) if args.quick else (64, 64, 3)
    if args.compare:
        sys.exit(compare(batch, tokens, rounds))
    print(f"batch {batch}, {tokens} tokens per request, median of {rounds} round(s); target ratio >= 0.85")
    print("| backend | JSON-schema batch tok/s | free batch tok/s | ratio | compile ms/schema (median, max) |")
    print("|---|---:|---:|---:|---:|")
    for backend in args.backend or BACKENDS:
        r = measure(backend, batch, tokens, rounds)
        print(f"| {r['backend']} | {r['constrained']:.1f} | {r['free']:.1f} | {r['ratio']:.2f} | "
              f"{r['compile_median_ms']:.1f}, {r['compile_max_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
