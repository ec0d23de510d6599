"""Paged attention against a per-sequence reference: chunked prefill, decode, GQA, sliding windows.

Every attention backend the installed plugins register runs the same cases (a contract suite).
"""

from __future__ import annotations

import math

import pytest
import torch

from modelrunner.forward_batch import ForwardBatch
from modelrunner.errors import UnknownNameError
from modelrunner.layers import Attention, AttentionBackend
from modelrunner.layers.sdpa_attention import SDPASplitMetadata
from modelrunner.plugins import get_plugins

BLOCK = 4
HEAD_DIM = 8

PLUGINS = get_plugins()
BACKENDS = PLUGINS.attention_backends()


def _attention(backend, heads, kv_heads, window):
    if backend not in PLUGINS.attention_backends("cpu"):
        pytest.skip(f"attention backend {backend!r} does not run on this CPU")
    return Attention(heads, HEAD_DIM, HEAD_DIM**-0.5, kv_heads, sliding_window=window,
                     backend=PLUGINS.attention_backend("cpu", backend))


def _scenario(context_lens, query_lens, heads, kv_heads, num_blocks=64, seed=0):
    """Random K/V history per sequence, the first ``context_lens`` of it already in a shuffled paged cache."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, HEAD_DIM)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, positions, starts, tables = [], [], [0], []
    slots = []
    for ctx, q in zip(context_lens, query_lens):
        total = ctx + q
        table = [free.pop() for _ in range(math.ceil(total / BLOCK))]
        k = torch.randn(total, kv_heads, HEAD_DIM, generator=gen)
        v = torch.randn(total, kv_heads, HEAD_DIM, generator=gen)
        query = torch.randn(q, heads, HEAD_DIM, generator=gen)
        for p in range(ctx):
            cache[0, table[p // BLOCK], p % BLOCK] = k[p]
            cache[1, table[p // BLOCK], p % BLOCK] = v[p]
        seqs.append((ctx, query, k, v))
        positions += range(ctx, total)
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, total)]
        starts.append(starts[-1] + q)
        tables.append(table)
    width = max(map(len, tables))
    n = starts[-1]
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.tensor(positions),
        seq_ids=tuple(range(len(seqs))),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens)]),
        context_lens=torch.tensor(context_lens),
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
        block_size=BLOCK,
        max_query_len=max(query_lens),
        max_seq_len=max(c + q for c, q in zip(context_lens, query_lens)),
    )
    return batch, cache, seqs


def _reference(seqs, heads, kv_heads, window):
    out = []
    for ctx, query, k, v in seqs:
        total = k.shape[0]
        group = heads // kv_heads
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [total, heads, d]
        scores = torch.einsum("qhd,khd->hqk", query, kk) / math.sqrt(HEAD_DIM)
        qpos = torch.arange(ctx, total)[:, None]
        kpos = torch.arange(total)[None, :]
        visible = kpos <= qpos
        if window is not None:
            visible &= kpos > qpos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv).reshape(len(query), heads * HEAD_DIM))
    return torch.cat(out)


CASES = {
    "mixed-chunked-prefill": ([0, 5, 9, 0], [6, 3, 1, 11]),
    "long-chunk-among-decodes": ([5, 0, 12, 3], [1, 14, 1, 1]),
    "chunk-on-cache-among-decodes": ([9, 6], [1, 7]),
    "decode-only": ([5, 12, 1, 7], [1, 1, 1, 1]),
    "fresh-single-prompt": ([0], [13]),
    "single-chunk-on-cache": ([8], [5]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 2)])
@pytest.mark.parametrize("window", [None, 3])
def test_matches_reference(backend, case, heads, kv_heads, window):
    context_lens, query_lens = CASES[case]
    batch, cache, seqs = _scenario(context_lens, query_lens, heads, kv_heads)
    attn = _attention(backend, heads, kv_heads, window)
    metadata = attn.backend.build_metadata(batch, (None, window))
    query = torch.cat([s[1] for s in seqs])
    key = torch.cat([s[2][s[0]:] for s in seqs])
    value = torch.cat([s[3][s[0]:] for s in seqs])
    out = attn(query, key, value, cache, metadata)
    # Steps mixing decodes with longer queries run as two parts (decodes unpadded).
    assert isinstance(metadata, SDPASplitMetadata) == (1 in query_lens and max(query_lens) > 1)
    assert out.shape == (batch.num_tokens, heads * HEAD_DIM)
    torch.testing.assert_close(out, _reference(seqs, heads, kv_heads, window), atol=1e-5, rtol=1e-5)
    # The new keys/values were written at their slots.
    flat = cache.view(2, -1, kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat[0, batch.slot_mapping], key)
    torch.testing.assert_close(flat[1, batch.slot_mapping], value)


def test_backend_seam():
    assert "torch_sdpa" in PLUGINS.attention_backends()
    assert PLUGINS.registry.owner("attention_backends", "torch_sdpa") == "default-sdpa"
    # The default is the highest-priority backend that runs here.
    usable = [PLUGINS.attention_backend("cpu", name) for name in PLUGINS.attention_backends("cpu")]
    assert PLUGINS.attention_backend("cpu").name == max(usable, key=lambda b: b.priority).name
    with pytest.raises(UnknownNameError, match="unknown attention backend 'nope'; installed: .*torch_sdpa"):
        PLUGINS.attention_backend("cpu", "nope")
    assert issubclass(type(PLUGINS.attention_backend("cpu")), AttentionBackend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,heads,kv_heads,window", [
    ("decode-only", 6, 2, None),
    ("decode-only", 6, 2, 3),
    ("decode-only", 4, 4, None),
    ("mixed-chunked-prefill", 4, 2, 3),
])
def test_compiled_matches_reference(backend, case, heads, kv_heads, window):
    # Compiled, torch_sdpa's decode steps attend through reductions over the paged cache rather than SDPA.
    context_lens, query_lens = CASES[case]
    batch, cache, seqs = _scenario(context_lens, query_lens, heads, kv_heads)
    attn = _attention(backend, heads, kv_heads, window)

    def step(query, key, value, cache, batch):
        return attn(query, key, value, cache, attn.backend.build_metadata(batch, (None, window)))

    query = torch.cat([s[1] for s in seqs])
    key = torch.cat([s[2][s[0]:] for s in seqs])
    value = torch.cat([s[3][s[0]:] for s in seqs])
    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True)(query, key, value, cache, batch)
    torch.testing.assert_close(out, _reference(seqs, heads, kv_heads, window), atol=1e-5, rtol=1e-5)
    flat = cache.view(2, -1, kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat[0, batch.slot_mapping], key)
    torch.testing.assert_close(flat[1, batch.slot_mapping], value)
