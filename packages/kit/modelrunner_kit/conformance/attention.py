"""The attention-backend suite: paged attention against a per-sequence reference.

Every case builds a paged KV cache with each sequence's history scattered over shuffled blocks,
runs one step of new queries through the backend (eager, then under ``torch.compile(fullgraph=True)``
for a subset) and compares the output with plain softmax attention computed per sequence; it also
checks the new keys and values landed at their slots. Cases cover chunked prefill mixed with decodes,
speculative verifications (a few new tokens on a cached sequence), decode-only steps, lone prompts,
grouped-query attention and a sliding window (skipped for a backend declaring
``supports_sliding_window = False``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from .base import Check, ConformanceError, NotApplicable, Suite, expect

BLOCK_SIZE = 4
"""KV-cache block size of every case (lowered to a backend's ``max_block_size`` when that is smaller)."""
HEAD_DIM = 8
"""Head size of every case."""

CASES: dict[str, tuple[list[int], list[int]]] = {
    "mixed-chunked-prefill": ([0, 5, 9, 0], [6, 3, 1, 11]),
    "long-chunk-among-decodes": ([5, 0, 12, 3], [1, 14, 1, 1]),
    "chunk-on-cache-among-decodes": ([9, 6], [1, 7]),
    "decode-only": ([5, 12, 1, 7], [1, 1, 1, 1]),
    "fresh-single-prompt": ([0], [13]),
    "single-chunk-on-cache": ([8], [5]),
    "verifications-among-decodes": ([9, 6, 14, 3], [5, 1, 3, 1]),  # speculative decoding's 1 + k tokens
    "verification-beside-a-long-chunk": ([9, 0, 4], [5, 20, 1]),
}
"""Case name → (tokens already cached, new tokens) per sequence of the step."""
HEADS = ((4, 4), (4, 2), (6, 2))
"""(query heads, key/value heads) of every case."""
WINDOWS = (None, 3)
"""Sliding windows of every case (None: full causal attention)."""
COMPILED = (("decode-only", 6, 2, None), ("decode-only", 6, 2, 3), ("decode-only", 4, 4, None),
            ("mixed-chunked-prefill", 4, 2, 3))
"""(case, heads, kv heads, window) also run under ``torch.compile(fullgraph=True)``."""


@attrs.frozen
class Scenario:
    """One step over a paged cache: the batch, the cache holding each sequence's history, the step's
    new queries/keys/values, and each sequence's whole history for the reference."""

    batch: Any
    """The step's :class:`~modelrunner.forward_batch.ForwardBatch`."""
    cache: torch.Tensor
    """``[2, num_blocks, block_size, kv_heads, head_dim]``, the cached tokens written."""
    query: torch.Tensor
    """``[tokens, heads, head_dim]`` of the new tokens."""
    key: torch.Tensor
    """``[tokens, kv_heads, head_dim]`` of the new tokens; ``value`` likewise."""
    value: torch.Tensor
    sequences: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per sequence ``(cached tokens, its queries, all its keys, all its values)``."""


def paged_scenario(context_lens: Sequence[int], query_lens: Sequence[int], heads: int, kv_heads: int,
                   block_size: int = BLOCK_SIZE, head_dim: int = HEAD_DIM, num_blocks: int = 64, seed: int = 0,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Scenario:
    """Random keys/values per sequence, the first ``context_lens`` of them already in a paged cache
    whose blocks are shuffled, and ``query_lens`` new tokens per sequence for the step."""
    from modelrunner.api import ForwardBatch

    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, positions, starts, tables, slots = [], [], [0], [], []
    for ctx, q in zip(context_lens, query_lens):
        total = ctx + q
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
        query = torch.randn(q, heads, head_dim, generator=gen).to(dtype)
        for p in range(ctx):
            cache[0, table[p // block_size], p % block_size] = k[p]
            cache[1, table[p // block_size], p % block_size] = v[p]
        seqs.append((ctx, query, k, v))
        positions += range(ctx, total)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, total)]
        starts.append(starts[-1] + q)
        tables.append(table)
    width = max(map(len, tables))
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    batch = ForwardBatch(
        input_ids=torch.zeros(starts[-1], dtype=torch.long), positions=torch.tensor(positions),
        seq_ids=tuple(range(len(seqs))), query_start_loc=torch.tensor(starts), seq_lens=torch.tensor(seq_lens),
        context_lens=torch.tensor(list(context_lens)), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]), block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    ).to(device)
    return Scenario(batch=batch, cache=cache.to(dtype).to(device), query=torch.cat([s[1] for s in seqs]).to(device),
                    key=torch.cat([s[2][s[0]:] for s in seqs]).to(device),
                    value=torch.cat([s[3][s[0]:] for s in seqs]).to(device), sequences=seqs)


def reference_attention(scenario: Scenario, heads: int, kv_heads: int, window: int | None) -> torch.Tensor:
    """Plain causal softmax attention of each sequence's queries over its whole history, in float32:
    ``[tokens, heads * head_dim]``."""
    out = []
    for ctx, query, k, v in scenario.sequences:
        total, head_dim = k.shape[0], k.shape[-1]
        group = heads // kv_heads
        kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", query.float(), kk) / math.sqrt(head_dim)
        qpos, kpos = torch.arange(ctx, total)[:, None], torch.arange(total)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(len(query), heads * head_dim))
    return torch.cat(out)


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float) -> None:
    try:
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)
    except AssertionError as e:
        raise ConformanceError(f"{what}: {' '.join(str(e).split())}") from None


def _heads_label(heads: int, kv_heads: int) -> str:
    return f"mha{heads}x{kv_heads}" if heads == kv_heads else f"gqa{heads}x{kv_heads}"


class AttentionBackendSuite(Suite):
    """Checks one attention backend against :func:`reference_attention` on every case of :data:`CASES`.

    :param device: where the backend runs (every check is skipped when it does not support it).
    """

    kind = "attention_backends"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, device: str = "cpu") -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.device = torch.device(device)
        """Where the cases run."""
        self._backend: Any = None

    def backend_class(self) -> type:
        """The backend class under test (the chosen plugin's, else the one the kernel would use).

        :raises ConformanceError: no loaded plugin provides the name.
        """
        return self.plugins.registry.get_class(self.kind, self.name, self.provider())

    def _setup(self) -> Any:
        """The backend instance, made once; NotApplicable on a device it does not support."""
        if self._backend is None:
            cls = self.backend_class()
            if not cls.supports(self.device):
                raise NotApplicable(f"attention backend {self.name!r} does not run on {self.device} "
                                    f"(its supports({self.device.type!r}) is False)")
            self._backend = cls()
        return self._backend

    def _layout(self) -> tuple[int, torch.dtype, float]:
        cls = type(self._setup())
        block = min(BLOCK_SIZE, cls.max_block_size or BLOCK_SIZE)
        dtypes = cls.dtypes
        dtype = torch.float32 if dtypes is None or torch.float32 in dtypes else dtypes[0]
        return block, dtype, 1e-5 if dtype == torch.float32 else 3e-2

    def _run_case(self, case: str, heads: int, kv_heads: int, window: int | None, compiled: bool) -> None:
        from modelrunner.api import Attention

        backend = self._setup()
        if window is not None and not type(backend).supports_sliding_window:
            raise NotApplicable(f"attention backend {self.name!r} declares supports_sliding_window = False")
        block, dtype, tol = self._layout()
        scenario = paged_scenario(*CASES[case], heads, kv_heads, block_size=block, dtype=dtype, device=self.device)
        attn = Attention(heads, HEAD_DIM, HEAD_DIM**-0.5, kv_heads, sliding_window=window, backend=backend)

        def step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, batch: Any) -> Any:
            return attn(query, key, value, cache, backend.build_metadata(batch, (None, window)))

        if compiled:
            torch._dynamo.reset()
            step = torch.compile(step, fullgraph=True)
        batch, cache = scenario.batch, scenario.cache
        out = step(scenario.query, scenario.key, scenario.value, cache, batch)
        expect(isinstance(out, torch.Tensor) and tuple(out.shape) == (batch.num_tokens, heads * HEAD_DIM),
               f"output shape {list(getattr(out, 'shape', []))}, expected [{batch.num_tokens}, {heads * HEAD_DIM}] "
               "(tokens, heads * head_dim)")
        what = f"{case}, {heads} heads over {kv_heads} kv heads, window {window}"
        _close(out, reference_attention(scenario, heads, kv_heads, window), f"output vs reference ({what})", tol)
        flat = cache.view(2, -1, kv_heads, HEAD_DIM)
        _close(flat[0, batch.slot_mapping], scenario.key, f"new keys at their slot_mapping slots ({what})", 0)
        _close(flat[1, batch.slot_mapping], scenario.value, f"new values at their slot_mapping slots ({what})", 0)

    def checks(self) -> list[Check]:
        """Eager checks of every case × heads × window, then compiled checks of :data:`COMPILED`."""
        out = []
        for case in CASES:
            for heads, kv_heads in HEADS:
                for window in WINDOWS:
                    out.append(self._check("eager", case, heads, kv_heads, window))
        out += [self._check("compiled", *c) for c in COMPILED]
        return out

    def _check(self, mode: str, case: str, heads: int, kv_heads: int, window: int | None) -> Check:
        name = f"{mode}/{case}/{_heads_label(heads, kv_heads)}/window={'none' if window is None else window}"
        return Check(name, lambda: self._run_case(case, heads, kv_heads, window, mode == "compiled"))


__all__ = ["BLOCK_SIZE", "CASES", "COMPILED", "HEADS", "HEAD_DIM", "WINDOWS", "AttentionBackendSuite", "Scenario",
           "paged_scenario", "reference_attention"]
