"""``modelrunner serve --speculative-config JSON``: the same completions as without, and vLLM's
speculative-decoding counters on ``/metrics``."""

from __future__ import annotations

import argparse

import pytest

from modelrunner import LLM, SamplingParams

from .conftest import TINY_CONFIG, TINY_ENV, TINY_LLM_CONFIG, ServerProcess

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": null}'


def test_bad_speculative_config_is_refused_before_loading(capsys):
    from modelrunner_serve.cli import add_parser

    parser = argparse.ArgumentParser(prog="modelrunner")
    add_parser(parser.add_subparsers())
    for bad, message in [('{"method": "ngram", "num_speculative_tokens": 0}',
                          "num_speculative_tokens must be a positive integer, got 0"),
                         ("{ngram", "not JSON")]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["serve", "--speculative-config", bad])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    args = parser.parse_args(["serve", "--speculative-config", SPEC])
    assert args.speculative_config["num_speculative_tokens"] == 3


def test_speculative_server_matches_offline_greedy_and_counts(serve_llama_dir):
    prompt = "one two three one two three one two three one two"
    want = LLM(str(serve_llama_dir), **TINY_LLM_CONFIG).generate(
        prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--speculative-config", SPEC], env=TINY_ENV)
    with proc.serving():
        got = proc.client().completions.create(model=str(serve_llama_dir), prompt=prompt, max_tokens=24,
                                                temperature=0.0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want
        metrics = proc.metrics()
    assert metrics["modelrunner:spec_decode_num_drafts_total"] >= 1
    assert metrics["modelrunner:spec_decode_num_draft_tokens_total"] >= \
        metrics["modelrunner:spec_decode_num_accepted_tokens_total"] >= 0
