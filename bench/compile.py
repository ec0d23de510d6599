"""Compile backends against eager on the default model (SmolLM2-135M, float32, CPU): decode-step time
and cold vs warm start.

Each backend runs in fresh processes. The cold process starts with an empty ``compile_cache_dir``;
the warm one starts again with the directory the cold one filled. *Start* is the time from the
process's first line to the end of a first short generation (4 new tokens of one prompt): imports,
loading, compiling or loading compiled code, and running. The *decode step* is
``runner.execute_model`` of one decode step (the model's forward and the LM head) over sequences
with 128 tokens of context, the median of repeated steps once the step's graphs exist. Each
backend's process also times the eager model (weights prepacked, as the ``eager`` backend runs it)
on the same runner, in alternating rounds, and the
ratio is taken against that: two processes run minutes apart see different loads on a shared
machine, one process alternating sees the same.

    python bench/compile.py                     # every installed backend (slow: compiling takes minutes)
    python bench/compile.py --backends inductor # just one
    python bench/compile.py --quick             # a tiny random model, to check that it runs
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTEXT = 128
"""Tokens already in the cache of every sequence of the timed decode steps."""
TARGET_SPEEDUP = 1.3
"""The inductor backend's decode target: this many times faster than eager."""
TARGET_WARM_FRACTION = 0.25
"""The warm start's target: at most this fraction of the cold start."""


# -- what a child process measures ----------------------------------------------------------------


def decode_batch(runner: Any, rows: int, context: int, first_seq_id: int) -> Any:
    """A decode step of ``rows`` fresh sequences with ``context`` cached tokens each (their KV is not
    computed: only its size matters to the step's cost)."""
    import torch

    from modelrunner import ForwardBatch

    alloc, block_size = runner.scratch_allocator(), runner.block_size
    slots, tables = [], []
    for i in range(rows):
        seq_id = first_seq_id + i
        alloc.allocate(seq_id, [3 + (i * 7 + j) % 1000 for j in range(context)])
        alloc.append_slots(seq_id, [5])
        slots += alloc.slot_mapping(seq_id, context, context + 1)
        tables.append(alloc.block_table(seq_id))
    width = max(len(t) for t in tables)
    return ForwardBatch(
        input_ids=torch.full((rows,), 5, dtype=torch.long),
        positions=torch.full((rows,), context, dtype=torch.long),
        seq_ids=tuple(range(first_seq_id, first_seq_id + rows)),
        query_start_loc=torch.arange(rows + 1),
        seq_lens=torch.full((rows,), context + 1, dtype=torch.long),
        context_lens=torch.full((rows,), context, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        logits_indices=torch.arange(rows),
        block_size=block_size,
        max_query_len=1,
        max_seq_len=context + 1,
    )


def time_decode(runner: Any, rows: int, steps: int, first_seq_id: int) -> tuple[float, float]:
    """Median seconds of ``runner.execute_model`` on one decode step of ``rows`` sequences, with the
    backend's callable and with the eager model, measured in alternating rounds in this process (so
    both see the same load from other processes)."""
    batch = decode_batch(runner, rows, CONTEXT, first_seq_id)
    loaded = runner.loaded
    compiled, eager = loaded.runnable, loaded.model
    for runnable in (compiled, eager):  # compiles the step's graph if needed
        loaded.runnable = runnable
        for _ in range(3):
            runner.execute_model(batch)
    times: dict[int, list[float]] = {id(compiled): [], id(eager): []}
    try:
        for _ in range(max(1, steps // 5)):
            for runnable in (compiled, eager):
                loaded.runnable = runnable
                for _ in range(5):
                    start = time.perf_counter()
                    runner.execute_model(batch)
                    times[id(runnable)].append(time.perf_counter() - start)
    finally:
        loaded.runnable = compiled
        for i in range(rows):
            runner.scratch_allocator().free(first_seq_id + i)
    return statistics.median(times[id(compiled)]), statistics.median(times[id(eager)])


def child(args: argparse.Namespace) -> None:
    from modelrunner import LLM, SamplingParams

    config: dict[str, Any] = {"model": args.model}
    if args.attention:
        config["attention_backend"] = args.attention
    if args.backend != "eager":
        config.update(compile=True, compile_backend=args.backend, compile_cache_dir=args.cache,
                      compile_options=json.loads(args.compile_options))
    llm = LLM(**config)
    llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    result: dict[str, Any] = {"start": time.perf_counter() - PROCESS_START}
    from modelrunner.layers import Attention

    result["attention"] = next((m.backend.name for m in llm.runner.loaded.model.modules() if isinstance(m, Attention)),
                               "none")
    if args.backend != "eager":
        from modelrunner.layers.dense import prepack_weights

        # The eager model timed beside the backend, its weights packed as the default CPU backend
        # (cpu_fused) packs them (compiled graphs keep their own weights).
        prepack_weights(llm.runner.loaded.model)
    for rows in args.batches:
        ours, eager = time_decode(llm.runner, rows, args.steps, first_seq_id=10_000 + rows * 1000)
        result[f"decode_b{rows}"], result[f"eager_b{rows}"] = ours, eager
    result["compile"] = llm.runner.stats().get("compile", {})
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent: run the children and print the table ---------------------------------------------


def run_child(model: str, backend: str, cache: str, batches: list[int], steps: int,
              options: str = "{}", attention: str = "") -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--backend", backend, "--cache", cache,
           "--steps", str(steps), f"--batches={','.join(map(str, batches))}", "--compile-options", options,
           f"--attention={attention}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{backend} child failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def installed_backends() -> list[str]:
    from modelrunner.plugins import get_registry

    return [name for name in get_registry().names("compile_backends") if name != "eager"]


def machine_line() -> str:
    import torch

    load1 = os.getloadavg()[0]
    line = f"torch {torch.__version__}, {torch.get_num_threads()} threads on {os.cpu_count()} cores, load {load1:.2f}"
    if load1 > 0.5:
        line += " (WARNING: other processes compete for the CPU; these numbers are noisy)"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny random model: check that the benchmark runs")
    parser.add_argument("--backends", help="comma list of compile backends (default: every installed one but eager)")
    parser.add_argument("--model", default="smollm2", help="the checkpoint (default: smollm2)")
    parser.add_argument("--batches", default="1,32", help="decode batch sizes to time (default: 1,32)")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per batch size (per model)")
    parser.add_argument("--compile-options", default="{}", help="JSON compile_options for every backend")
    parser.add_argument("--attention", default="", help="attention_backend of every run (default: the best installed)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",") if b]
    if args.child:
        child(args)
        return 0
    if args.quick:
        args.model, args.steps = tiny_model(), 5
    backends = args.backends.split(",") if args.backends else installed_backends()
    options = f", compile_options={args.compile_options}" if args.compile_options != "{}" else ""
    print(f"compile backends vs eager on {args.model}{options}: {machine_line()}", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    rows["eager"] = run_child(args.model, "eager", "", args.batches, args.steps, attention=args.attention)
    rows["eager"]["warm"] = run_child(args.model, "eager", "", [], args.steps, attention=args.attention)["start"]
    print(f"attention backend: {rows['eager']['attention']}", flush=True)
    for backend in backends:
        with tempfile.TemporaryDirectory(prefix=f"bench-compile-{backend}-") as cache:
            try:
                cold = run_child(args.model, backend, cache, args.batches, args.steps, args.compile_options,
                                 args.attention)
                warm = run_child(args.model, backend, cache, [], args.steps, args.compile_options, args.attention)
            except RuntimeError as e:
                print(f"  {backend}: FAILED, left out of the table: {e}", flush=True)
                continue
        rows[backend] = {**cold, "warm": warm["start"], "warm_compile": warm["compile"]}
        print(f"  {backend}: done ({cold['compile'].get('compiles', '?')} compiles cold)", flush=True)
    report(rows, args.batches)
    return 0


def report(rows: dict[str, dict[str, Any]], batches: list[int]) -> None:
    """The table: each backend's decode step beside the eager model's, timed in the same process."""
    head = f"{'backend':<10}" + "".join(f"{f'b{b} ms':>9}{f'eager b{b} ms':>15}{'×eager':>8}" for b in batches)
    head += f"{'start cold s':>14}{'start warm s':>14}{'warm/cold':>11}"
    print(head)
    for name, row in rows.items():
        line = f"{name:<10}"
        for b in batches:
            ours, eager = row[f"decode_b{b}"], row[f"eager_b{b}"]
            line += f"{ours * 1e3:>9.1f}{eager * 1e3:>15.1f}{eager / ours:>8.2f}"
        line += f"{row['start']:>14.1f}{row['warm']:>14.1f}{row['warm'] / row['start']:>11.2f}"
        print(line)
    for name, row in rows.items():
        if name == "eager":
            continue
        cold, warm = row["compile"], row.get("warm_compile", {})
        print(f"{name}: cold process {json.dumps(_brief(cold))}; warm process {json.dumps(_brief(warm))}")
    if "inductor" in rows:
        row = rows["inductor"]
        for b in batches:
            speedup = row[f"eager_b{b}"] / row[f"decode_b{b}"]
            verdict = "met" if speedup >= TARGET_SPEEDUP else "MISSED"
            print(f"target inductor decode b{b} >= {TARGET_SPEEDUP}x eager: {speedup:.2f}x {verdict}")
        fraction = row["warm"] / row["start"]
        verdict = "met" if fraction <= TARGET_WARM_FRACTION else "MISSED"
        print(f"target inductor warm start <= {TARGET_WARM_FRACTION:.0%} of cold: {fraction:.0%} {verdict}")


def _brief(stats: dict[str, Any]) -> dict[str, Any]:
    keys = ("compiles", "recompiles", "fx_graph_cache", "package_loads", "compile_seconds", "load_seconds",
            "cache_warnings")
    return {k: stats[k] for k in keys if k in stats}


def tiny_model() -> str:
    """A 2-layer random Llama with SmolLM2's tokenizer, saved once under the temp dir."""
    from pathlib import Path

    path = Path(tempfile.gettempdir()) / "modelrunner-bench-tiny-llama"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from modelrunner.loading.source import resolve_source

    tok = resolve_source("smollm2").load_tokenizer()  # built from the GGUF file's metadata
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
