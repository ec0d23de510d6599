"""The flattened ForwardBatch of one step: offsets, positions, slots, block tables, sampled rows."""

from __future__ import annotations

import pytest
import torch

from modelrunner.engine.batch_builder import build_forward_batch
from modelrunner.engine.sampling_params import SamplingParams
from modelrunner.engine.scheduler import ScheduledSequence
from modelrunner.engine.outputs import RequestMetrics
from modelrunner.engine.sequence import Request, Sequence
from modelrunner.kv_cache.paged import PagedBlockAllocator


def _seq(seq_id: int, tokens: list[int], extra=None) -> Sequence:
    request = Request(request_id=str(seq_id), prompt=None, prompt_token_ids=tokens[:3], params=SamplingParams(),
                      arrival=seq_id, metrics=RequestMetrics(0.0), extra=extra or {})
    seq = Sequence(seq_id=seq_id, request=request, index=0, token_ids=list(tokens))
    request.seqs.append(seq)
    return seq


def test_mixed_prefill_chunk_and_decode():
    alloc = PagedBlockAllocator(num_blocks=16, block_size=4, max_model_len=64, enable_prefix_caching=False)
    decode = _seq(0, [5, 6, 7, 8, 9, 10])  # 5 computed, its last token is new
    alloc.allocate(0, decode.token_ids[:5])
    alloc.append_slots(0, decode.token_ids[5:])
    chunked = _seq(1, list(range(20, 30)))  # a 10-token prompt: this step computes tokens 0..5 only
    alloc.allocate(1, chunked.token_ids[:6])
    finishing = _seq(2, [40, 41, 42], extra={"images": "img"})  # a whole 3-token prompt
    alloc.allocate(2, finishing.token_ids)
    scheduled = [ScheduledSequence(decode, 5, 1), ScheduledSequence(chunked, 0, 6), ScheduledSequence(finishing, 0, 3)]

    batch, rows = build_forward_batch(scheduled, alloc, finished_seq_ids=(9,))
    assert batch.input_ids.tolist() == [10, 20, 21, 22, 23, 24, 25, 40, 41, 42]
    assert batch.positions.tolist() == [5, 0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert batch.query_start_loc.tolist() == [0, 1, 7, 10]
    assert batch.context_lens.tolist() == [5, 0, 0] and batch.seq_lens.tolist() == [6, 6, 3]
    assert batch.max_query_len == 6 and batch.max_seq_len == 6
    tables = [alloc.block_table(i) for i in range(3)]
    assert batch.block_tables.tolist() == [t + [0] * (2 - len(t)) for t in tables]
    expected_slots = alloc.slot_mapping(0, 5, 6) + alloc.slot_mapping(1, 0, 6) + alloc.slot_mapping(2, 0, 3)
    assert batch.slot_mapping.tolist() == expected_slots
    # The decode and the completed prompt are sampled; the intermediate chunk is not.
    assert batch.logits_indices.tolist() == [0, 9] and [(o.item, o.position, o.samples) for o in rows] == [
        (0, 5, True), (2, 2, True)]
    assert batch.seq_ids == (0, 1, 2) and batch.finished_seq_ids == (9,)
    assert batch.extra == {"images": {2: "img"}}

    # One step's sequences on their own (what a backend runs when it splits a step).
    part = batch.select(torch.tensor([0, 2]))
    assert batch.token_rows(torch.tensor([0, 2])).tolist() == [0, 7, 8, 9]
    assert part.input_ids.tolist() == [10, 40, 41, 42] and part.positions.tolist() == [5, 0, 1, 2]
    assert part.query_start_loc.tolist() == [0, 1, 4] and part.seq_ids == (0, 2)
    assert part.seq_lens.tolist() == [6, 3] and part.context_lens.tolist() == [5, 0]
    assert part.block_tables.tolist() == [batch.block_tables[0].tolist(), batch.block_tables[2].tolist()]
    assert part.slot_mapping.tolist() == alloc.slot_mapping(0, 5, 6) + alloc.slot_mapping(2, 0, 3)
    assert part.logits_indices.tolist() == [0, 3] and part.max_query_len == 3 and part.max_seq_len == 6
    chunk = batch.select(torch.tensor([1]))
    assert chunk.input_ids.tolist() == [20, 21, 22, 23, 24, 25] and chunk.logits_indices.tolist() == []
    # The decode apart from the two prompts.
    (decode_rows, decodes), (other_rows, others) = batch.split_decodes()
    assert decode_rows.tolist() == [0] and decodes.seq_ids == (0,) and decodes.logits_indices.tolist() == [0]
    assert other_rows.tolist() == list(range(1, 10)) and others.seq_ids == (1, 2)
    assert others.logits_indices.tolist() == [8] and others.max_query_len == 6


def test_decode_only_batch():
    alloc = PagedBlockAllocator(num_blocks=8, block_size=4, max_model_len=32)
    seqs = [_seq(i, [1 + i, 2, 3, 4, 5]) for i in range(3)]
    for s in seqs:
        alloc.allocate(s.seq_id, s.token_ids[:4])
        alloc.append_slots(s.seq_id, s.token_ids[4:])
    batch, rows = build_forward_batch([ScheduledSequence(s, 4, 1) for s in seqs], alloc)
    assert batch.is_decode_only and batch.positions.tolist() == [4, 4, 4]
    assert batch.logits_indices.tolist() == [0, 1, 2] and [o.item for o in rows] == [0, 1, 2]
    assert batch.split_decodes() is None


def test_empty_step_is_an_error():
    with pytest.raises(ValueError, match="zero scheduled sequences"):
        build_forward_batch([], PagedBlockAllocator(num_blocks=1, block_size=4, max_model_len=4))
