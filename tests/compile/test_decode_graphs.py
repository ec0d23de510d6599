"""Decode steps replayed from recorded graphs (the ``cpu_fused`` backend's ``decode_graphs``, on by
default): the same tokens as eager steps, hooks still run, and the switch and its errors.

Where this CPU's torch refuses to record (``torch.jit.trace`` fails on some builds), the graphs turn
themselves off with the reason in ``stats()``, and the tests that need a recording are skipped with it."""

from __future__ import annotations

import pytest
import torch

from modelrunner import LLM, SamplingParams
from llama.test_llama_parity import _checkpoint
from modelrunner_compile_cpu_fused.decode_graphs import SIGHTINGS

PROMPTS = [[5, 9, 17], [3, 44, 21, 8, 90, 11, 2], [70, 71]]
KW = dict(dtype="float32", kv_cache_memory=2**20, max_model_len=128, block_size=4)


def _generate(llm: LLM, max_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their logprobs for :data:`PROMPTS`."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


def _tokens(results: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    return [tokens for tokens, _ in results]


@pytest.mark.parametrize("name", ["llama-gqa-untied-biases", "mistral-sliding-window", "qwen2-sliding-layers"])
def test_replayed_decode_steps_give_the_eager_steps_tokens_and_logprobs(tmp_path, name):
    _checkpoint(name, tmp_path)
    replayed = LLM(str(tmp_path), **KW)
    eager = LLM(str(tmp_path), compile_options={"decode_graphs": False}, **KW)
    assert _generate(replayed) == _generate(eager)
    stats = replayed.runner.stats()["compile"]["decode_graphs"]
    _skip_if_recording_failed(stats)
    # Three sequences decode together for 11 steps: one key, recorded at its SIGHTINGS-th step.
    assert stats["graphs"] == 1 and stats["replays"] == 11 - SIGHTINGS and stats["refused"] == {}
    assert "decode_graphs" not in eager.runner.stats()["compile"]


def _skip_if_recording_failed(stats: dict) -> None:
    failed = [reason for reason in stats["refused"].values() if reason.startswith("recording failed")]
    if failed:
        pytest.skip(f"torch cannot record decode graphs on this machine: {failed[0]}")


def test_speculative_verifications_replay_as_decode_rows(tmp_path):
    # The model drafting for itself: every proposal is accepted, so each step verifies 1 + 3 tokens of
    # one sequence; cpu_paged runs them as four decode rows, which replay one recorded graph.
    _checkpoint("llama-gqa-untied-biases", tmp_path)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eager = LLM(str(tmp_path), compile_options={"decode_graphs": False}, **KW)
    want = eager.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(tmp_path), speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3,
                                                  "disable_by_batch_size": None}, **KW)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want
    assert out.metrics.spec_num_accepted_tokens == out.metrics.spec_num_draft_tokens > 20
    stats = llm.runner.stats()["compile"]["decode_graphs"]
    _skip_if_recording_failed(stats)
    assert stats["graphs"] >= 1 and stats["replays"] >= 4 and stats["refused"] == {}, stats


def test_a_hook_added_after_recording_runs_on_every_step(tmp_path):
    _checkpoint("llama-gqa-tied", tmp_path)
    llm = LLM(str(tmp_path), **KW)
    before = _tokens(_generate(llm))  # later runs hit the prefix cache: the same tokens, logprobs ~1e-7 apart
    graphs = llm.runner.runner.loaded.model.decode_graphs
    _skip_if_recording_failed(graphs.stats())
    replays = graphs.replays
    calls = []
    handle = llm.runner.runner.loaded.model.model.layers[1].mlp.register_forward_hook(
        lambda module, args, out: calls.append(args[0].shape[0]))
    try:
        assert _tokens(_generate(llm)) == before
    finally:
        handle.remove()
    assert graphs.replays == replays  # every step ran eagerly while hooked
    assert len(calls) == 1 + 11 and calls[1:] == [3] * 11  # the prompts' step, then 11 decode steps
    assert _tokens(_generate(llm)) == before and graphs.replays > replays  # unhooked: replayed again


def test_a_part_not_declared_graph_safe_keeps_every_step_eager(tmp_path):
    from modelrunner_compile_cpu_fused.decode_graphs import register_graph_safe, unsafe_part
    from modelrunner.models.decoder import GatedMLP

    class LoggingMLP(GatedMLP):
        pass

    mlp = LoggingMLP.__new__(LoggingMLP)
    torch.nn.Module.__init__(mlp)
    assert unsafe_part([mlp]).endswith("LoggingMLP")
    register_graph_safe(LoggingMLP)
    assert unsafe_part([mlp]) is None


class _CountingActivation(torch.nn.Module):
    """SiluAndMul plus the number of calls so far: Python state a recording would freeze."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.inner(x) + self.calls * 1e-3


def test_a_recording_whose_replay_differs_is_refused_and_the_key_stays_eager(tmp_path):
    from modelrunner_compile_cpu_fused.decode_graphs import register_graph_safe

    _checkpoint("llama-gqa-tied", tmp_path)
    llm = LLM(str(tmp_path), **KW)
    model = llm.runner.runner.loaded.model
    mlp = model.model.layers[0].mlp
    mlp.act_fn = _CountingActivation(mlp.act_fn)
    graphs = model.decode_graphs
    graphs.clear()
    assert graphs.stats()["off"].endswith("_CountingActivation is not declared graph-safe")
    register_graph_safe(_CountingActivation)  # wrongly: its output depends on a Python counter
    graphs.clear()
    _generate(llm)
    stats = graphs.stats()
    _skip_if_recording_failed(stats)
    assert stats["graphs"] == 0 and stats["replays"] == 0
    assert [reason.split(" (")[0] for reason in stats["refused"].values()] == ["replay differs from the eager step"]
    calls = mlp.act_fn.calls
    _generate(llm)
    assert mlp.act_fn.calls == calls + 12  # every step ran the module itself


def test_the_option_is_checked(tmp_path):
    _checkpoint("llama-gqa-tied", tmp_path)
    with pytest.raises(ValueError, match=r"compile option 'decode_graphs' must be true or false, got 'yes'"):
        LLM(str(tmp_path), compile_options={"decode_graphs": "yes"}, **KW)
