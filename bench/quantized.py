"""Quantized weights on the default model: modelrunner against llama.cpp on the same GGUF file, and
against modelrunner's own float32 path, every number measured in this run.

- single stream: 128 new tokens after a short prompt, decode tokens/s, ours (``gguf``) ÷ llama.cpp;
- prompt processing: one 256-token prompt to its first token, tokens/s, ours ÷ llama.cpp;
- batch: 64 prompts × 64 new tokens, output tokens/s, ``gguf`` ÷ float32 (exact, and with
  ``activations="auto"``: llama.cpp's int8 activations where faster) and ``int8`` ÷ float32 (the
  float32 and int8 runs read the file's float32 conversion, the checkpoint they start from);
- cold start: ``LLM(model="smollm2")`` to its first token in a fresh process with an empty
  ``MODELRUNNER_CACHE_DIR`` (no converted files, no kernel timings; the quant-cpu C++ extension,
  built once per install, is already built);
- the weight-read bandwidth each single-stream decode reaches, against this machine's streaming rate;
- real-size files (issue 51): a Llama-3.2-1B-shaped Q4_K_M written by llama.cpp's own quantizer
  (``bench/shaped_gguf.py``, random weights, cached under the cache directory), or ``--file``: each
  peer in a process of its own (``bench/gguf_peer.py``), load seconds, peak RSS, single-stream decode
  and a 256-token prompt, ours ÷ llama.cpp; then decode again with ``activations="int8"`` (llama.cpp's
  own arithmetic: int8 activations where a kernel has them), for comparison.

llama.cpp runs through ``llama-cpp-python`` (``make bench`` installs it; it builds from source), both
with the same number of threads (2 unless ``--threads``). Repetitions alternate between the peers
round by round so that drift on a shared machine hits both alike; medians are reported.

    python bench/quantized.py            # the full benchmark (several minutes on 2 cores)
    python bench/quantized.py --quick    # few tokens and rounds: to check that it runs
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from gguf_peer import LlamaCpp  # noqa: E402,F401 - the llama.cpp peer (bench/fast_paths.py imports it from here)

TARGETS = {"decode": 1.0, "prompt": 1.3, "batch gguf": 1.0, "batch int8": 1.3, "cold start s": 3.0}
"""The issue's targets: ratios (≥) and the cold start (seconds, ≤)."""
REAL_TARGETS = {"peak RSS": (1.3, "≤"), "load s": (3.0, "≤"), "decode": (1.0, "≥"), "prompt 256": (1.0, "≥")}
"""Issue 51's targets on the real-size file, ours ÷ llama.cpp."""


def stream_rate(threads: int, megabytes: int = 512, rounds: int = 7) -> float:
    """This machine's streaming read rate in GB/s: a ``sum`` over a buffer far larger than the caches."""
    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` seeded prompts of ``length`` token ids from the ordinary part of the vocabulary."""
    rng = random.Random(seed)
    return [[rng.randrange(200, vocab - 200) for _ in range(length)] for _ in range(count)]


class Ours:
    """modelrunner's ``LLM`` on the default model with one quantization method."""

    def __init__(self, model: str, quantization: str | None, **options: Any) -> None:
        from modelrunner import LLM, SamplingParams

        settings: dict[str, Any] = {} if quantization is None else {"quantization": quantization}
        if options:
            settings["quantization_options"] = options
        self.llm = LLM(model, **settings)
        self.params = SamplingParams
        self.tokenizer = self.llm.get_tokenizer()
        stats = self.llm.stats()
        self.weight_bytes = int(stats["weights"]["resident_bytes"])
        self.kernels = stats.get("quantization", {}).get("kernels") or stats.get("weights", {}).get("quantization")

    def _run(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        self.llm.reset_prefix_cache()
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.llm.generate(prompts, params, use_tqdm=False)

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """Decode tokens/s after the first token of one request."""
        out = self._run([prompt], new_tokens)[0]
        m = out.metrics
        return (m.num_generated_tokens - 1) / (m.last_token_time - m.first_token_time)

    def prompt_rate(self, prompt: list[int]) -> float:
        """Prompt tokens/s from the call to the first token."""
        start = time.perf_counter()
        self._run([prompt], 1)
        return len(prompt) / (time.perf_counter() - start)

    def batch_rate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Output tokens/s of all prompts together."""
        start = time.perf_counter()
        outs = self._run(prompts, new_tokens)
        seconds = time.perf_counter() - start
        return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def alternate(runs: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Run every ``label → callable`` once per round, in turn; the measured values per label."""
    values: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            values[label].append(run())
    return values


def summary(values: list[float]) -> str:
    """Median and range of one peer's repetitions."""
    return f"{statistics.median(values):8.1f}  ({min(values):.1f}–{max(values):.1f})"


def ratio_line(name: str, ratio: float) -> str:
    """A ratio with its target and whether it is met."""
    target = TARGETS[name]
    return f"   {name}: {ratio:.2f}×  (target ≥ {target:.1f}×: {'met' if ratio >= target else 'MISSED'})"


COLD_START = textwrap.dedent("""
    import time
    start = time.perf_counter()
    from modelrunner import LLM, SamplingParams
    imported = time.perf_counter()
    llm = LLM("smollm2")
    loaded = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    done = time.perf_counter()
    print(imported - start, loaded - imported, done - loaded)
""")


def cold_start(threads: int) -> tuple[float, float, float]:
    """(import, ``LLM(...)``, first token) seconds of a fresh process with an empty cache directory."""
    with tempfile.TemporaryDirectory(prefix="modelrunner-cold-") as cache:
        env = {**os.environ, "MODELRUNNER_CACHE_DIR": cache, "OMP_NUM_THREADS": str(threads)}
        result = subprocess.run([sys.executable, "-c", COLD_START], capture_output=True, text=True, env=env,
                                timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"cold-start run failed: {result.stderr.strip().splitlines()[-1:]}")
    imported, loaded, first = map(float, result.stdout.split()[-3:])
    return imported, loaded, first


class Peer:
    """A ``bench/gguf_peer.py`` process: one engine on one file, its own memory."""

    def __init__(self, kind: str, path: str, threads: int) -> None:
        here = os.path.dirname(os.path.abspath(__file__))
        # Python as installed runs it: with its bytecode cached (an environment that forbids writing it
        # makes every start compile modelrunner's sources again, 0.2 s that llama-cpp-python's never pay).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen([sys.executable, os.path.join(here, "gguf_peer.py"), kind, path, str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.loaded = self._answer()

    def _answer(self) -> dict[str, Any]:
        import json

        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the peer process exited ({self.proc.wait()}); its stderr above says why")
        return json.loads(line)

    def ask(self, **command: Any) -> dict[str, Any]:
        import json

        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        try:
            self.ask(op="quit")
        except (OSError, RuntimeError, ValueError):
            pass
        self.proc.wait(30)


def shaped_file(shape: str, ftype: str) -> str:
    """The cached ``shape`` file in ``ftype``, written by llama.cpp's quantizer the first time (minutes)."""
    from modelrunner.cache_dir import cache_root

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    from shaped_gguf import write_shaped

    path = cache_root() / "bench" / f"{shape}-{ftype.lower()}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (random weights, llama.cpp's quantizer; once) ...", flush=True)
        partial = path.with_name(path.name + ".partial")
        write_shaped(shape, ftype, str(partial))
        partial.replace(path)
    return str(path)


def real_size(path: str, threads: int, rounds: int, quick: bool) -> dict[str, float]:
    """Issue 51's comparison on ``path``: ours and llama.cpp each in a process of its own."""
    new_tokens, prompt_len = (16, 64) if quick else (64, 256)
    print(f"\n== real-size file: {path} ({os.path.getsize(path) / 2**20:.0f} MiB)")
    for kind in ("ours", "llama.cpp"):  # loads timed warm: the file in the page cache, each one's caches written
        Peer(kind, path, threads).close()
    ours = Peer("ours", path, threads)
    loads = {"ours": ours.loaded["load_s"]}
    peer = Peer("llama.cpp", path, threads)
    try:
        info = ours.loaded
        print(f"   ours: dtype {info.get('dtype')}, tensors {info.get('tensors')}, "
              f"weights {info.get('weight_mb', 0):.0f} MiB")
        print(f"   ours kernels: {info.get('kernels')}")
        vocab = 32000
        short = random_prompts(vocab, 1, 8, seed=1)[0]
        prompts = iter(random_prompts(vocab, 4 * rounds, prompt_len, seed=2))
        decode = alternate({name: lambda p=p: p.ask(op="decode", prompt=short, tokens=new_tokens)["rate"]
                            for name, p in (("ours", ours), ("llama.cpp", peer))}, rounds)
        prompt = alternate({"ours": lambda: ours.ask(op="prompt", prompt=next(prompts))["rate"],
                            "llama.cpp": lambda: peer.ask(op="prompt", prompt=next(prompts))["rate"]}, rounds)
        end = ours.ask(op="rss")
        print(f"   ours decode graphs: {end['graphs']}")
        rss = {"ours": end["peak_mb"], "llama.cpp": peer.ask(op="rss")["peak_mb"]}
        ours.close()
        # llama.cpp's own arithmetic for comparison (int8 activations), after the exact default has
        # gone: one model in memory at a time besides llama.cpp's.
        ours = Peer("ours-int8", path, threads)
        int8 = alternate({name: lambda p=p: p.ask(op="decode", prompt=short, tokens=new_tokens)["rate"]
                          for name, p in (("ours", ours), ("llama.cpp", peer))}, rounds)
    finally:
        ours.close()
        peer.close()
    rows = {"load s": (loads["ours"], peer.loaded["load_s"]),
            "peak RSS": (rss["ours"], rss["llama.cpp"]),
            "decode": (statistics.median(decode["ours"]), statistics.median(decode["llama.cpp"])),
            "prompt 256": (statistics.median(prompt["ours"]), statistics.median(prompt["llama.cpp"]))}
    print(f"   {'':<11} {'ours':>9} {'llama.cpp':>10}  ratio")
    results = {}
    for name, (a, b) in rows.items():
        target, sense = REAL_TARGETS[name]
        ratio = a / b
        met = ratio <= target if sense == "≤" else ratio >= target
        unit = {"load s": "s", "peak RSS": "MiB"}.get(name, "tok/s")
        print(f"   {name:<11} {a:9.1f} {b:10.1f}  {ratio:.2f}×  ({unit}; target {sense} {target:.1f}×: "
              f"{'met' if met else 'MISSED'})")
        results[name] = ratio
    ratio = statistics.median(int8["ours"]) / statistics.median(int8["llama.cpp"])
    print(f"   decode with activations='int8' (llama.cpp's arithmetic, not exact): "
          f"{statistics.median(int8['ours']):.1f} against {statistics.median(int8['llama.cpp']):.1f} tok/s, {ratio:.2f}×")
    for name, values in (("decode", decode), ("prompt 256", prompt), ("decode int8", int8)):
        print(f"   {name} rounds: ours {[round(v, 1) for v in values['ours']]}, "
              f"llama.cpp {[round(v, 1) for v in values['llama.cpp']]}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few tokens and rounds, to check that it runs")
    parser.add_argument("--threads", type=int, default=2, help="threads for both peers (default 2)")
    parser.add_argument("--rounds", type=int, default=None, help="repetitions per measurement")
    parser.add_argument("--file", help="the real-size comparison on this GGUF file (and nothing else)")
    parser.add_argument("--shape", default="llama-3.2-1b", help="the real-size file's shape (bench/shaped_gguf.py)")
    parser.add_argument("--ftype", default="Q4_K_M", help="the real-size file's llama.cpp file type")
    parser.add_argument("--no-real-size", action="store_true", help="skip the real-size comparison")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.file:
        real_size(args.file, args.threads, args.rounds or (2 if args.quick else 5), args.quick)
        return 0
    quick = args.quick
    rounds = args.rounds or (2 if quick else 5)
    new_single, prompt_len = (16, 64) if quick else (128, 256)
    batch, new_batch = (8, 8) if quick else (64, 64)

    load1 = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {args.threads} threads on {os.cpu_count()} cores; load average {load1:.2f}")
    if load1 > 0.5:
        print(f"WARNING: load average {load1:.2f} before the run: other processes compete for the CPU; "
              "rerun on a quiet machine")
    if os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE":
        print("WARNING: OMP_WAIT_POLICY=PASSIVE: torch's threads sleep between matmuls, which slows small "
              "decode steps by about a quarter; unset it to measure what users get")
    rate = stream_rate(args.threads)
    print(f"streaming read rate: {rate:.1f} GB/s")

    from modelrunner.loading.source import resolve_source

    source = resolve_source("smollm2")
    path, dense_dir = str(source.path), str(source.directory)  # the file, and its float32 conversion
    source.release_weights()
    gguf = Ours("smollm2", None)  # exact: float activations (the default)
    fast = Ours("smollm2", None, activations="auto")  # llama.cpp's int8 activations where faster
    print(f"file: {path} ({os.path.getsize(path) / 1e6:.1f} MB); ours resident weights "
          f"{gguf.weight_bytes / 1e6:.1f} MB; kernels: {gguf.kernels}")
    try:
        peer = LlamaCpp(path, args.threads)
    except ImportError:
        print("llama-cpp-python is not installed (`make bench` installs it): skipping the llama.cpp ratios")
        peer = None
    vocab = len(gguf.tokenizer)
    short = random_prompts(vocab, 1, 8, seed=1)[0]
    results: dict[str, float] = {}

    if peer is not None:
        print(f"\n== single stream: {new_single} new tokens after {len(short)} prompt tokens, decode tokens/s")
        values = alternate({"ours": lambda: gguf.decode_rate(short, new_single),
                            "ours auto": lambda: fast.decode_rate(short, new_single),
                            "llama.cpp": lambda: peer.decode_rate(short, new_single)}, rounds)
        for label, v in values.items():
            print(f"   {label:<10} {summary(v)}")
        results["decode"] = statistics.median(values["ours"]) / statistics.median(values["llama.cpp"])
        print(ratio_line("decode", results["decode"]))
        auto = statistics.median(values["ours auto"]) / statistics.median(values["llama.cpp"])
        print(f"   with activations=auto: {auto:.2f}×")
        for label, source, v in (("ours", gguf, values["ours"]), ("ours auto", fast, values["ours auto"]),
                                 ("llama.cpp", peer, values["llama.cpp"])):
            reached = source.weight_bytes * statistics.median(v) / 1e9
            print(f"   {label}: reads {source.weight_bytes / 1e6:.0f} MB of weights per token → {reached:.1f} GB/s "
                  f"= {reached / rate:.0%} of the streaming rate")

        print(f"\n== prompt processing: one {prompt_len}-token prompt to its first token, tokens/s")
        prompts = iter(random_prompts(vocab, 4 * rounds, prompt_len, seed=2))
        values = alternate({"ours": lambda: gguf.prompt_rate(next(prompts)),
                            "llama.cpp": lambda: peer.prompt_rate(next(prompts))}, rounds)
        for label, v in values.items():
            print(f"   {label:<10} {summary(v)}")
        results["prompt"] = statistics.median(values["ours"]) / statistics.median(values["llama.cpp"])
        print(ratio_line("prompt", results["prompt"]))

    print(f"\n== batch: {batch} prompts × {new_batch} new tokens, output tokens/s")
    dense, int8 = Ours(dense_dir, None), Ours(dense_dir, "int8")
    print(f"   int8 kernels: {int8.kernels}")
    prompts = random_prompts(vocab, batch, 32, seed=3)
    values = alternate({"float32": lambda: dense.batch_rate(prompts, new_batch),
                        "gguf": lambda: gguf.batch_rate(prompts, new_batch),
                        "gguf auto": lambda: fast.batch_rate(prompts, new_batch),
                        "int8": lambda: int8.batch_rate(prompts, new_batch)}, max(2, rounds - 2))
    for label, v in values.items():
        print(f"   {label:<10} {summary(v)}")
    base = statistics.median(values["float32"])
    results["batch gguf"] = statistics.median(values["gguf"]) / base
    results["batch int8"] = statistics.median(values["int8"]) / base
    print(ratio_line("batch gguf", results["batch gguf"]))
    print(f"   batch gguf with activations=auto: {statistics.median(values['gguf auto']) / base:.2f}×")
    print(ratio_line("batch int8", results["batch int8"]))

    if not args.no_real_size:
        try:
            path = shaped_file(args.shape, args.ftype)
        except ImportError:
            print("\nllama-cpp-python is not installed (`make bench` installs it): skipping the real-size comparison")
        else:
            real_size(path, args.threads, rounds, quick)

    print("\n== cold start: LLM(model='smollm2') to its first token, fresh process, empty cache directory")
    imported, loaded, first = cold_start(args.threads)
    total = loaded + first
    print(f"   import {imported:.2f} s (not counted); LLM(...) {loaded:.2f} s; first token {first:.2f} s; "
          f"total {total:.2f} s (target ≤ {TARGETS['cold start s']:.0f} s: "
          f"{'met' if total <= TARGETS['cold start s'] else 'MISSED'})")
    after = os.getloadavg()[0]
    if after > args.threads + 0.5:
        print(f"WARNING: load average {after:.2f} after the run: the machine was busy; numbers are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
