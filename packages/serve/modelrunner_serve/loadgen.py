"""A load generator for OpenAI-compatible servers (this one, vLLM, …): asyncio + httpx, streamed
``/v1/completions`` with ``ignore_eos`` so every request produces exactly ``--output-len`` tokens.

Prompts are token ids (exactly ``--input-len`` each), cut from text the server itself tokenizes
(``/tokenize``). Requests start at ``--request-rate`` per second (Poisson arrivals; ``inf``: all at
once), at most ``--max-concurrency`` at a time. It prints request throughput, output tokens/s and the
p50/p90/p99 of TTFT (time to first token), TPOT (time per output token after the first), ITL
(time between streamed chunks) and E2E latency, and ``--output-json`` writes them with every
request's numbers. :func:`add_arguments` and :func:`run` make it a command-line tool; bench code
calls :func:`run_load` with prompts of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

TEXT = ("The history of the river valley begins with the first farmers who settled its banks, "
        "planting barley and lentils in the rich soil the floods left behind each spring. ")
"""Seed text for prompts (repeated and cut into token windows)."""


@attrs.define
class RequestResult:
    """What one request measured (seconds)."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = attrs.field(factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@attrs.frozen
class LoadResult:
    """A whole run: every request's result and the wall time."""

    results: list[RequestResult]
    duration_s: float

    @property
    def completed(self) -> list[RequestResult]:
        """The requests that succeeded."""
        return [r for r in self.results if r.ok]

    @property
    def output_throughput(self) -> float:
        """Output tokens per second over the run."""
        return sum(r.output_tokens for r in self.completed) / self.duration_s

    def summary(self) -> dict[str, Any]:
        """Throughputs and latency percentiles (milliseconds), as ``--output-json`` writes them."""
        done = self.completed
        out: dict[str, Any] = {
            "completed": len(done), "failed": len(self.results) - len(done), "duration_s": self.duration_s,
            "request_throughput": len(done) / self.duration_s, "output_throughput": self.output_throughput,
            "total_token_throughput": sum(r.output_tokens + r.prompt_tokens for r in done) / self.duration_s,
            "total_output_tokens": sum(r.output_tokens for r in done),
        }
        series = {"ttft": [r.ttft for r in done if r.ttft is not None],
                  "tpot": [r.tpot for r in done if r.tpot is not None],
                  "itl": [x for r in done for x in r.itls], "e2e": [r.e2e for r in done if r.e2e is not None]}
        for name, values in series.items():
            out[f"mean_{name}_ms"] = 1000 * sum(values) / len(values) if values else math.nan
            for p in (50, 90, 99):
                out[f"p{p}_{name}_ms"] = 1000 * percentile(values, p)
        return out


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (linear interpolation, as numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def _one(client: httpx.AsyncClient, model: str | None, prompt: list[int], output_len: int) -> RequestResult:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error event")
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", ())):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(base_url: str, prompts: Sequence[list[int]], output_len: int, max_concurrency: int,
                   request_rate: float = math.inf, model: str | None = None, api_key: str | None = None,
                   seed: int = 0, timeout_s: float = 600.0) -> LoadResult:
    """Send one streamed completion per prompt and measure each.

    :param request_rate: requests started per second on average (Poisson); ``inf``: all at once.
    :param max_concurrency: most requests in flight at a time.
    """
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout_s, limits=limits) as client:
        async def limited(prompt: list[int]) -> RequestResult:
            async with gate:
                return await _one(client, model, prompt, output_len)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return LoadResult(list(results), time.perf_counter() - start)


async def token_prompts(base_url: str, count: int, length: int, api_key: str | None = None,
                        seed: int = 0) -> list[list[int]]:
    """``count`` different prompts of exactly ``length`` token ids, cut from :data:`TEXT` as the server
    tokenizes it (``POST /tokenize``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as client:
        repeats = 1 + (length + count) // 20
        response = await client.post("/tokenize", json={"prompt": TEXT * repeats, "add_special_tokens": False})
        response.raise_for_status()
        ids = response.json()["tokens"]
    rng = random.Random(seed)
    starts = [rng.randrange(0, max(1, len(ids) - length)) for _ in range(count)]
    return [ids[s:s + length] for s in starts]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The load generator's options."""
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--model", default=None, help="the model name to send (default: none; the server's own)")
    parser.add_argument("--api-key", default=None, help="bearer token (default: $MODELRUNNER_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to send (default %(default)s)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="most in flight (default %(default)s)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed for prompts and arrivals (default 0)")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="write the results as JSON")


def print_summary(summary: dict[str, Any], file: Any = sys.stdout) -> None:
    """The summary as a table."""
    print(f"requests: {summary['completed']} completed, {summary['failed']} failed in {summary['duration_s']:.2f} s",
          file=file)
    print(f"request throughput: {summary['request_throughput']:.2f} req/s   output: "
          f"{summary['output_throughput']:.1f} tok/s   total: {summary['total_token_throughput']:.1f} tok/s", file=file)
    print(f"{'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}", file=file)
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = "".join(f"{summary[f'{k}_{name}_ms']:>10.1f}" for k in ("mean", "p50", "p90", "p99"))
        print(f"{name.upper():<6}{row}", file=file)


def run(args: argparse.Namespace) -> int:
    """Drive the server at ``--base-url``; 0 when every request succeeded, 1 otherwise.

    :raises ValueError: a bad option, or a server that cannot be reached (one line, for the CLI).
    """
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    api_key = args.api_key or os.environ.get("MODELRUNNER_API_KEY")
    try:
        prompts = asyncio.run(token_prompts(args.base_url, args.num_prompts, args.input_len, api_key, args.seed))
    except httpx.HTTPStatusError as e:
        status, text = e.response.status_code, e.response.text[:200]
        raise ValueError(f"{args.base_url}/tokenize answered {status}: {text}") from None
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach the server at {args.base_url}: {type(e).__name__}: {e}") from None
    load = asyncio.run(run_load(args.base_url, prompts, args.output_len, args.max_concurrency, args.request_rate,
                                args.model, api_key, args.seed))
    summary = load.summary()
    print_summary(summary)
    if args.output_json:
        config = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                  for k, v in vars(args).items() if k not in ("api_key", "func")}
        record = {"config": config,
                  "summary": summary, "requests": [attrs.asdict(r) for r in load.results]}
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2, default=str)
    errors = [r.error for r in load.results if not r.ok]
    if errors:
        print(f"{len(errors)} request(s) failed; first: {errors[0]}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m modelrunner_serve.loadgen``."""
    parser = argparse.ArgumentParser(prog="modelrunner-loadgen", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as e:
        print(f"modelrunner: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
