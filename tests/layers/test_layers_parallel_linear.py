"""Weight loaders give each tensor-parallel rank its slice; the slices recombine to the full layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelrunner.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 32, 4, 4, 2


def _load(param, tensor, shard_id=None):
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_by_heads_and_replicates_scarce_kv_heads(tp_size):
    w = {s: torch.randn((HEADS if s == "q" else KV_HEADS) * HEAD_DIM, HIDDEN) for s in "qkv"}
    b = {s: torch.randn(w[s].shape[0]) for s in "qkv"}
    x = torch.randn(3, HIDDEN)
    full = {s: F.linear(x, w[s], b[s]) for s in "qkv"}
    for rank in range(tp_size):
        layer = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, bias=True, tp_rank=rank, tp_size=tp_size)
        for i, s in enumerate("qkv"):
            _load(layer.weight, w[s], s if rank % 2 else i)  # names and indices both work
            _load(layer.bias, b[s], s)
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        hq = HEADS // tp_size * HEAD_DIM
        kv_rank = rank // max(1, tp_size // KV_HEADS)
        torch.testing.assert_close(q, full["q"][:, rank * hq:(rank + 1) * hq])
        torch.testing.assert_close(k, full["k"][:, kv_rank * layer.kv_size:(kv_rank + 1) * layer.kv_size])
        torch.testing.assert_close(v, full["v"][:, kv_rank * layer.kv_size:(kv_rank + 1) * layer.kv_size])


def test_merged_column_and_row_parallel_recombine():
    torch.manual_seed(0)  # the inputs must not depend on which tests ran before
    gate, up, down = torch.randn(16, HIDDEN), torch.randn(16, HIDDEN), torch.randn(HIDDEN, 16)
    x = torch.randn(3, HIDDEN)
    full = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    partials = []
    for rank in range(2):
        gate_up = MergedColumnParallelLinear(HIDDEN, [16, 16], tp_rank=rank, tp_size=2)
        _load(gate_up.weight, gate, 0)
        _load(gate_up.weight, up, 1)
        row = RowParallelLinear(16, HIDDEN, tp_rank=rank, tp_size=2)
        _load(row.weight, down)
        g, u = gate_up(x).chunk(2, dim=-1)
        partials.append(F.linear(F.silu(g) * u, row.weight))  # what each rank adds into the all-reduce
    # The layers multiply through oneDNN, the reference through MKL: float32 sums in another order.
    torch.testing.assert_close(sum(partials), full, atol=1e-4, rtol=1e-5)


def test_column_and_replicated_load_whole_or_sliced():
    w, b = torch.randn(8, HIDDEN), torch.randn(8)
    x = torch.randn(2, HIDDEN)
    col = ColumnParallelLinear(HIDDEN, 8, bias=True, tp_rank=1, tp_size=2)
    _load(col.weight, w)
    _load(col.bias, b)
    torch.testing.assert_close(col(x), F.linear(x, w, b)[:, 4:])
    rep = ReplicatedLinear(HIDDEN, 8, bias=True)
    _load(rep.weight, w)
    _load(rep.bias, b)
    torch.testing.assert_close(rep(x), F.linear(x, w, b))


def test_vocab_split_pads_the_last_rank():
    table = torch.randn(10, HIDDEN)
    hidden = torch.randn(2, HIDDEN)
    logits = []
    for rank in range(4):
        emb = VocabParallelEmbedding(10, HIDDEN, tp_rank=rank, tp_size=4)
        _load(emb.weight, table)
        assert emb.weight.shape == (3, HIDDEN)
        head = ParallelLMHead(10, HIDDEN, tp_rank=rank, tp_size=4)
        head.tie(emb)
        assert head.weight is emb.weight
        logits.append(F.linear(hidden, head.weight))  # what each rank contributes to the all-gather
    torch.testing.assert_close(torch.cat(logits, -1)[:, :10], hidden @ table.T)
    assert torch.cat(logits, -1)[:, 10:].abs().sum() == 0  # padding rows are zero
    single = VocabParallelEmbedding(10, HIDDEN)
    _load(single.weight, table)
    torch.testing.assert_close(single(torch.tensor([3, 9])), table[[3, 9]])


def test_wrong_shapes_and_shards_are_explained():
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS)
    with pytest.raises(ValueError, match=r"expected shape \[8, 32\], got \[16, 32\]"):
        _load(qkv.weight, torch.zeros(16, HIDDEN), "k")
    with pytest.raises(ValueError, match="shard_id must be 'q', 'k' or 'v', got 'x'"):
        _load(qkv.weight, torch.zeros(8, HIDDEN), "x")
    row = RowParallelLinear(16, HIDDEN, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"expected shape \[32, 16\], got \[32, 8\]"):
        _load(row.weight, torch.zeros(HIDDEN, 8))
    with pytest.raises(ValueError, match=r"number of attention heads \(4\) is not divisible by the tensor-parallel size \(3\)"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, tp_rank=0, tp_size=3)
