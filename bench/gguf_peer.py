"""One peer of bench/quantized.py's real-size comparison, in a process of its own so that its memory
is its own: modelrunner or llama.cpp (llama-cpp-python) on one GGUF file, driven by JSON lines.

    python bench/gguf_peer.py ours|llama.cpp FILE THREADS

It loads the file (reporting the seconds and the peak RSS), then answers commands on stdin, one JSON
object per line, with one JSON line on stdout:

- ``{"op": "decode", "prompt": [...], "tokens": N}`` → ``{"rate": tokens/s}`` after the first token;
- ``{"op": "prompt", "prompt": [...]}`` → ``{"rate": prompt tokens/s}`` to the first token;
- ``{"op": "rss"}`` → ``{"peak_mb": ..., "now_mb": ..., "graphs": ...}`` (ours: its decode graphs);
  ``{"op": "quit"}`` ends it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def rss_mb() -> tuple[float, float]:
    """(peak, current) resident set of this process in MB. The peak is the process's own memory's high-water
    mark (``VmHWM``): ``ru_maxrss`` also counts the parent's peak at the fork that started this process
    (Linux carries it across exec), which made both peers report the 5 GB of the parent that had just
    written a GGUF file."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        pass
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return peak, now


class Ours:
    """modelrunner on the file, as ``LLM(path)`` runs it (``dtype="auto"``, its default kernels)."""

    def __init__(self, path: str, threads: int, activations: str | None = None) -> None:
        import torch

        from modelrunner import LLM, SamplingParams

        torch.set_num_threads(threads)
        options = {} if activations is None else {"quantization_options": {"activations": activations}}
        self.llm = LLM(path, max_model_len=1024, **options)
        self.params = SamplingParams
        stats = self.llm.stats()
        self.info = {"dtype": stats.get("dtype", {}).get("runs"),
                     "kernels": stats.get("quantization", {}).get("kernels"),
                     "tensors": stats.get("quantization", {}).get("tensors"),
                     "weight_mb": int(stats["weights"]["resident_bytes"]) / 2**20}

    def graphs(self) -> Any:
        """What the compile backend says of its decode graphs (recorded during the first decode steps)."""
        return self.llm.stats().get("compile", {}).get("decode_graphs")

    def _run(self, prompt: list[int], tokens: int) -> Any:
        self.llm.reset_prefix_cache()
        params = self.params(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        return self.llm.generate([prompt], params, use_tqdm=False)[0]

    def decode_rate(self, prompt: list[int], tokens: int) -> float:
        m = self._run(prompt, tokens).metrics
        return (m.num_generated_tokens - 1) / (m.last_token_time - m.first_token_time)

    def prompt_rate(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self._run(prompt, 1)
        return len(prompt) / (time.perf_counter() - start)


class LlamaCpp:
    """llama.cpp through llama-cpp-python on the same file (mapped, as llama.cpp runs it)."""

    label = "llama.cpp"

    def __init__(self, path: str, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, n_batch=512,
                         verbose=False)
        self.weight_bytes = os.path.getsize(path)
        self.info: dict[str, Any] = {}

    def _times(self, prompt: list[int], count: int) -> list[float]:
        """Times at which each of ``count`` greedy tokens arrived (the first after the prompt), from the start."""
        self.llm.reset()
        start = time.perf_counter()
        times = []
        for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter() - start)
            if len(times) == count:
                break
        return times

    def decode_rate(self, prompt: list[int], new_tokens: int) -> float:
        """Decode tokens/s after the first token."""
        times = self._times(prompt, new_tokens)
        return (len(times) - 1) / (times[-1] - times[0])

    def prompt_rate(self, prompt: list[int]) -> float:
        """Prompt tokens/s to the first token."""
        return len(prompt) / self._times(prompt, 1)[0]

    def graphs(self) -> Any:
        return None


def main() -> int:
    kind, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    start = time.perf_counter()
    if kind == "llama.cpp":
        peer: Any = LlamaCpp(path, threads)
    else:  # ours, or ours-<activations> (e.g. ours-int8: llama.cpp's int8 activations where a kernel has them)
        peer = Ours(path, threads, kind.partition("-")[2] or None)
    loaded = time.perf_counter() - start
    peak, now = rss_mb()
    print(json.dumps({"load_s": loaded, "peak_mb": peak, "now_mb": now, **peer.info}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "decode":
            answer: dict[str, Any] = {"rate": peer.decode_rate(command["prompt"], command["tokens"])}
        elif op == "prompt":
            answer = {"rate": peer.prompt_rate(command["prompt"])}
        else:
            peak, now = rss_mb()
            answer = {"peak_mb": peak, "now_mb": now, "graphs": peer.graphs()}
        print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
