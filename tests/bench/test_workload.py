"""Seeded synthetic prompts and JSONL datasets."""

from __future__ import annotations

import json

import pytest
from modelrunner_bench.workload import Workload, WorkloadSpec, build_workload, read_dataset, synthetic_prompts


def test_synthetic_prompts_are_reproducible_and_exactly_as_long_as_asked(smollm2_tokenizer):
    a = synthetic_prompts(5, 37, seed=3, tokenizer=smollm2_tokenizer)
    assert a == synthetic_prompts(5, 37, seed=3, tokenizer=smollm2_tokenizer)
    assert a != synthetic_prompts(5, 37, seed=4, tokenizer=smollm2_tokenizer)
    assert [len(p) for p in a] == [37] * 5 and len({tuple(p) for p in a}) == 5
    text = smollm2_tokenizer.decode(a[0])
    assert text.strip() and all(w.isalpha() for w in text.split()[:-1])  # plain words


def test_without_a_tokenizer_token_ids_are_drawn_below_the_vocabulary():
    prompts = synthetic_prompts(3, 10, seed=1, vocab_size=50)
    assert prompts == synthetic_prompts(3, 10, seed=1, vocab_size=50)
    assert all(len(p) == 10 and all(0 <= t < 50 for t in p) for p in prompts)


def test_the_digest_names_the_work():
    spec = WorkloadSpec(num_prompts=2, input_len=4, output_len=3)
    a, b = build_workload(spec, vocab_size=100), build_workload(spec, vocab_size=100)
    assert a.digest == b.digest and a.output_lens == [3, 3]
    other = build_workload(WorkloadSpec(num_prompts=2, input_len=4, output_len=4), vocab_size=100)
    assert other.digest != a.digest
    assert a.describe() == {"source": "synthetic", "num_prompts": 2, "prompt_tokens": 8, "min_prompt_len": 4,
                            "max_prompt_len": 4, "output_tokens": 6, "constrained_prompts": 0,
                            "lora_prompts": 0, "lora_adapters": 0, "digest": a.digest}


def test_a_dataset_gives_text_and_token_prompts_with_their_own_lengths(tmp_path, smollm2_tokenizer):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "The river runs", "output_len": 5}) + "\n\n"
                    + json.dumps({"prompt_token_ids": [7, 8, 9]}) + "\n"
                    + json.dumps({"prompt": "third"}) + "\n")
    w = build_workload(WorkloadSpec(num_prompts=2, output_len=11, dataset=str(path), input_len=None),
                       tokenizer=smollm2_tokenizer)
    assert w.prompts == [smollm2_tokenizer.encode("The river runs"), [7, 8, 9]]
    assert w.output_lens == [5, 11] and w.source == str(path)


@pytest.mark.parametrize("content,message", [
    ("", "no prompts in the file"),
    ('{"prompt": "ok"}\nnot json\n', r"line 2: not JSON"),
    ('["a list"]\n', r"line 1: expected an object"),
    ('{"promt": "typo"}\n', r"line 1: needs a non-empty 'prompt' string or 'prompt_token_ids' \(keys: \['promt'\]\)"),
    ('{"prompt_token_ids": [1, -2]}\n', r"line 1: prompt_token_ids must be a non-empty list of token ids"),
    ('{"prompt": "x", "output_len": 0}\n', r"line 1: output_len must be a positive integer, got 0"),
    ('{"prompt": "x", "structured_outputs": "json"}\n', r"line 1: structured_outputs must be an object"),
    ('{"prompt": "x", "structured_outputs": {"jsn": {}}}\n', r"line 1: structured_outputs: .*'jsn'"),
    ('{"prompt": "x", "structured_outputs": {"json": {}, "regex": "a"}}\n', r"line 1: structured_outputs: "),
])
def test_a_malformed_dataset_names_the_line(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        read_dataset(path)


def test_text_prompts_need_a_tokenizer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    with pytest.raises(ValueError, match="entry 0 is text, but this model has no tokenizer"):
        build_workload(WorkloadSpec(dataset=str(path), input_len=None), tokenizer=None, vocab_size=10)


def test_dataset_constraints_become_each_prompts_structured_outputs(tmp_path, smollm2_tokenizer):
    path = tmp_path / "constrained.jsonl"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    path.write_text(json.dumps({"prompt": "A number", "structured_outputs": {"json": schema}}) + "\n"
                    + json.dumps({"prompt": "Free"}) + "\n")
    w = build_workload(WorkloadSpec(output_len=7, dataset=str(path), input_len=None), tokenizer=smollm2_tokenizer)
    constrained, free = w.sampling_params()
    assert constrained.structured_outputs.json == schema and not constrained.ignore_eos
    assert free.structured_outputs is None and free.ignore_eos and free.max_tokens == 7
    assert w.describe()["constrained_prompts"] == 1
    unconstrained = Workload(w.prompts, w.output_lens, w.source)
    assert unconstrained.digest != w.digest  # a constraint is part of the work
