"""A step's float32 logits reuse the previous step's buffer only when nobody holds it: logits a caller
keeps are never written over, through ``execute_model`` too."""

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


def test_logits_a_caller_keeps_are_not_written_over_by_the_next_step(tiny_llama_dir):
    # Through execute_model on a bfloat16 model: a prefill step's logits, kept while a decode step of the
    # same rows runs (same shape: the buffer would be reused if nothing held it), equal the same prefill
    # run alone.
    from compile.helpers import step_logits

    runner = ModelRunner({"model": str(tiny_llama_dir), "dtype": "bfloat16", "kv_cache_memory": 1 << 24})
    runner.load_model()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    prefill, decode = step_logits(runner, prompts, [[12, 13]])
    (alone,) = step_logits(runner, prompts, [])
    assert prefill.dtype == torch.float32 and prefill.shape == decode.shape
    assert torch.equal(prefill, alone) and not torch.equal(prefill, decode)
