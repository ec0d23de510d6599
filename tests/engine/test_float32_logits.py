"""A step's float32 logits reuse the previous step's buffer only when nobody holds it: logits a caller
keeps are never written over, and a model run in bfloat16 gives the same logits either way."""

from __future__ import annotations

import torch

from modelrunner import ModelRunner
from modelrunner.models.forward import float32_logits


def test_a_buffer_is_reused_only_when_no_view_of_it_is_alive():
    state: dict = {}
    first = torch.randn(4, 10).bfloat16()
    out = float32_logits(state, first)
    assert out.dtype == torch.float32 and torch.equal(out, first.float())
    address = out.data_ptr()
    del out
    again = float32_logits(state, first * 2)
    assert again.data_ptr() == address and torch.equal(again, (first * 2).float())  # nothing held it
    row = again[1]  # a caller keeps a view of this step's logits
    later = float32_logits(state, first * 3)
    assert later.data_ptr() != address and torch.equal(row, (first * 2).float()[1])
    del later
    fewer = float32_logits(state, first[:2] * 4)  # fewer rows: the rows of the same buffer
    assert fewer.shape == (2, 10) and torch.equal(fewer, (first[:2] * 4).float())
    assert float32_logits(state, first.float()).dtype == torch.float32  # float32 already: as it is


def test_a_bfloat16_model_returns_the_same_logits_whatever_the_caller_keeps(tiny_llama_dir):
    runner = ModelRunner({"model": str(tiny_llama_dir), "dtype": "bfloat16", "kv_cache_memory": 1 << 24})
    runner.load_model()
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    kept = [runner.forward(row) for row in ids]  # each call's logits stacked from the steps' buffers
    again = [runner.forward(row) for row in ids]
    for a, b in zip(kept, again):
        assert a.dtype == torch.float32 and torch.equal(a, b)
