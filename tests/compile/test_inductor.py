"""The inductor backend: bucketed decode shapes without recompiles, options validated with clear errors."""

from __future__ import annotations

import pytest
import torch

from modelrunner import ForwardBatch, LLM
from modelrunner.errors import UnknownNameError

from .helpers import PROMPTS, make_llm, step_logits

pytest.importorskip("modelrunner_compile_inductor")

from modelrunner_compile_inductor import InductorOptions, bucket_for, pad_decode_batch  # noqa: E402


def test_decode_steps_reuse_their_bucket_without_recompiling(compiled_llm, eager_llm):
    llm = compiled_llm("inductor")[0]
    tokenizer = eager_llm.get_tokenizer()
    # Four sequences fill the bucket the three-row steps were padded to; 20 steps cross block boundaries.
    prompts = [tokenizer.encode(p) for p in PROMPTS + ["Four"]]
    # The fixture's greedy generation of the three prompts already ran padded three-row steps.
    before = llm.runner.stats()["compile"]
    assert before["steps_by_shape"]["decode[4]"] > 0 and before["padded_rows"] > 0, before
    step_logits(llm.runner, prompts, [[11, 12, 13, 14]] * 20)
    stats = llm.runner.stats()["compile"]
    assert stats["recompiles"] == 0, stats
    assert stats["compiles_by_shape"]["decode[4]"] == 1, stats
    assert stats["steps_by_shape"]["decode[4]"] - before["steps_by_shape"]["decode[4]"] == 20, stats


def test_frozen_decode_matches_eager_with_one_graph_for_every_row_count(tiny_llama_dir, eager_llm, tmp_path):
    llm = make_llm(tiny_llama_dir, "inductor", tmp_path, options={"freeze_min_batch": 2})
    tokenizer = eager_llm.get_tokenizer()
    for prompts in (PROMPTS, PROMPTS + ["Four", "and a fifth prompt"]):
        ids = [tokenizer.encode(p) for p in prompts]
        decode = [[20 + row for row in range(len(ids))]] * 3
        for actual, expected in zip(step_logits(llm.runner, ids, decode), step_logits(eager_llm.runner, ids, decode)):
            assert (actual - expected).abs().max().item() <= 1e-4
    stats = llm.runner.stats()["compile"]
    assert stats["compiles_by_shape"]["decode[2+,frozen]"] == 1, stats
    assert stats["steps_by_shape"]["decode[2+,frozen]"] == 6
    assert stats["recompiles"] == 0 and stats["padded_rows"] == 0
    assert stats["fx_graph_cache"]["bypasses"] >= 1  # prepacked weights cannot be cached by torch


def test_bucket_for_rounds_up_and_passes_large_steps_through():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 9, 100]


def _decode_batch(rows: int) -> ForwardBatch:
    positions = torch.arange(rows) + 20
    tables = torch.arange(rows * 2).view(rows, 2)
    return ForwardBatch(
        input_ids=torch.arange(rows) + 5, positions=positions, seq_ids=tuple(range(rows)),
        query_start_loc=torch.arange(rows + 1), seq_lens=positions + 1, context_lens=positions,
        slot_mapping=tables[:, 1] * 16 + positions % 16, block_tables=tables, logits_indices=torch.arange(rows),
        block_size=16, max_query_len=1, max_seq_len=int(positions.max()) + 1,
    )


def test_padding_repeats_the_last_row_and_keeps_the_real_rows_first():
    batch = _decode_batch(3)
    padded = pad_decode_batch(batch, 8)
    assert padded.num_seqs == padded.num_tokens == 8
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "context_lens", "block_tables"):
        value, original = getattr(padded, name), getattr(batch, name)
        assert torch.equal(value[:3], original)
        assert all(torch.equal(row, original[-1]) for row in value[3:]), name
    assert torch.equal(padded.query_start_loc, torch.arange(9))
    assert torch.equal(padded.logits_indices, batch.logits_indices)
    assert padded.seq_ids == (0, 1, 2, 2, 2, 2, 2, 2)
    assert padded.max_seq_len == batch.max_seq_len and padded.max_query_len == 1
    assert pad_decode_batch(batch, 3) is batch


def test_padding_refuses_prefill_steps_and_shrinking():
    batch = _decode_batch(3)
    with pytest.raises(ValueError, match="cannot pad a step of 3 sequences down to 2"):
        pad_decode_batch(batch, 2)
    prefill = ForwardBatch(
        input_ids=torch.arange(4), positions=torch.arange(4), seq_ids=(0,), query_start_loc=torch.tensor([0, 4]),
        seq_lens=torch.tensor([4]), context_lens=torch.tensor([0]), slot_mapping=torch.arange(4),
        block_tables=torch.tensor([[0]]), logits_indices=torch.tensor([3]), block_size=16, max_query_len=4,
        max_seq_len=4,
    )
    with pytest.raises(ValueError, match="only decode steps"):
        pad_decode_batch(prefill, 8)


@pytest.mark.parametrize(
    ("mode", "options", "message"),
    [
        ("fastest", {}, "compile_mode 'fastest' is not a torch.compile mode; choose one of default, .*max-autotune"),
        ("default", {"freezng": True}, "unknown inductor compile option 'freezng'; did you mean 'freezing'"),
        ("default", {"freezing": "yes"}, "freezing must be 'auto', True or False; got 'yes'"),
        ("default", {"batch_buckets": [4, 2]}, r"strictly increasing; got \[4, 2\]"),
        ("default", {"batch_buckets": [0]}, "positive integers; got 0"),
        ("default", {"freeze_min_batch": 0}, "freeze_min_batch must be a positive integer; got 0"),
        ("default", {"inductor": {"max_autotun": True}}, "'max_autotun', which is not a torch._inductor.config"),
        ("default", {"inductor": {"freezing": True}}, "through the compile option 'freezing'"),
    ],
)
def test_bad_options_name_the_value_and_what_is_accepted(mode, options, message):
    with pytest.raises(ValueError, match=message):
        InductorOptions.from_config(mode, options)


def test_bad_options_fail_at_load_through_the_public_api(tiny_llama_dir):
    with pytest.raises(ValueError, match="compile_mode 'fastest' is not a torch.compile mode"):
        LLM(model=str(tiny_llama_dir), compile=True, compile_backend="inductor", compile_mode="fastest")


def test_unknown_backend_lists_the_installed_ones(tiny_llama_dir):
    with pytest.raises(UnknownNameError, match="unknown compile backend 'inductr'; installed: .*aot.*eager.*inductor.*"
                                               "Did you mean 'inductor'"):
        LLM(model=str(tiny_llama_dir), compile=True, compile_backend="inductr")


def test_freezing_auto_freezes_only_large_decode_buckets():
    options = InductorOptions.from_config("default", {"freeze_min_batch": 16})
    assert not options.freeze(None) and not options.freeze(8) and options.freeze(16)
    assert InductorOptions.from_config("default", {"freezing": True}).freeze(None)
    settings = InductorOptions.from_config("max-autotune-no-cudagraphs", {"inductor": {"cpp.simdlen": 256}}) \
        .inductor_settings(freeze=False)
    assert settings == {"max_autotune": True, "coordinate_descent_tuning": True, "cpp.simdlen": 256, "freezing": False}


def test_decodes_beside_a_long_prompt_chunk_run_apart_and_match_eager(compiled_llm, eager_llm):
    from modelrunner import SamplingParams

    llm = compiled_llm("inductor")[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    long_prompt = "one two three four five six seven eight nine ten " * 16  # ~160 tokens

    def run(engine_llm):
        engine = engine_llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"short-{i}", prompt, params)
        engine.step()  # the short prompts' prefill
        engine.step()  # a decode step
        engine.add_request("long", long_prompt, params)
        texts = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    texts[out.request_id] = out.outputs[0].text
        return texts

    before = llm.runner.stats()["compile"]["split_steps"]
    assert run(llm) == run(eager_llm)
    stats = llm.runner.stats()["compile"]
    # The step with three decodes beside the ~160-token prompt ran as two (3 x 160 padded queries otherwise).
    assert stats["split_steps"] > before, stats
    assert stats["recompiles"] == 0, stats
