"""In one process, without torch.distributed: how layers split into stages, stage models chained by
hand equal the whole model, the torchrun environment, and world size 1 staying a plain runner."""

from __future__ import annotations

import warnings

import attrs
import pytest
import torch

from modelrunner.distributed import STAGE_INPUTS, STAGE_OUTPUTS, LaunchInfo, stage_layer_range
from modelrunner.executor import UniprocExecutor, create_executor
from modelrunner.models import StageMissingLayer
from modelrunner.parallel_state import ParallelState
from modelrunner_kit.testing import PagedDriver, load_adapter

from .conftest import save_tiny_llama

TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}


def test_stage_layer_range_splits_contiguously_extra_layers_first():
    assert [stage_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layer_range(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layer_range(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert stage_layer_range(7, 0, 1) == (0, 7)
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        stage_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 2\), got 2"):
        stage_layer_range(4, 2, 2)


def test_launch_info_reads_torchrun_environment():
    assert LaunchInfo.from_env({}) is None
    assert LaunchInfo.from_env({**TORCHRUN_ENV, "WORLD_SIZE": "1"}) is None
    info = LaunchInfo.from_env({**TORCHRUN_ENV, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert (info.rank, info.world_size, info.local_rank, info.master_port, info.agent_store) == (3, 4, 1, 29511, True)
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        LaunchInfo.from_env({k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"})
    with pytest.raises(ValueError, match="RANK must be an integer, got 'zero'"):
        LaunchInfo.from_env({**TORCHRUN_ENV, "RANK": "zero"})


def test_world_size_one_is_a_plain_runner_and_torchrun_size_mismatch_is_named(tiny_llama, monkeypatch):
    assert type(create_executor({"model": str(tiny_llama)})) is UniprocExecutor
    for key, value in {**TORCHRUN_ENV, "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=r"4 processes were started, but tensor_parallel_size × "
                                         r"pipeline_parallel_size = 2 × 1 = 2"):
        create_executor({"model": str(tiny_llama), "tensor_parallel_size": 2, "device": "cpu"})


def _load(path, parallel: ParallelState):
    return load_adapter(path, parallel=parallel)


@pytest.mark.parametrize(("layers", "tie"), [(2, False), (3, True)], ids=["2-layers", "3-layers-tied"])
def test_stages_chained_by_hand_equal_the_whole_model(tmp_path, smollm2_tokenizer, layers, tie):
    path = save_tiny_llama(tmp_path, smollm2_tokenizer, num_layers=layers, tie=tie)
    whole = _load(path, ParallelState())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stage must not report the other stage's tensors as unused
        stages = [_load(path, ParallelState(pp_rank=r, pp_size=2)) for r in range(2)]
    first, last = (s.loaded.model for s in stages)
    assert [s.loaded.kv_cache_spec.num_layers for s in stages] == [layers - layers // 2, layers // 2]
    assert not any(n.startswith(("lm_head.", "model.norm.")) for n, _ in first.named_parameters())
    assert not any(n.startswith(f"model.layers.{first.model.end_layer - 1}.") for n, _ in last.named_parameters())
    assert isinstance(first.model.layers[layers - 1], StageMissingLayer)
    assert isinstance(last.model.embed_tokens, StageMissingLayer) != tie  # a tied head keeps the embedding

    split = stages[0].loaded.kv_cache_spec.num_layers

    def chained(batch, kv):
        out = stages[0].forward(batch, kv[:split])
        assert out.logits.shape == (0, whole.loaded.vocab_size)
        batch = attrs.evolve(batch, extra={STAGE_INPUTS: out.aux[STAGE_OUTPUTS]})
        return stages[1].forward(batch, kv[split:])

    prompts = {0: [5, 9, 2, 77, 31, 8, 100], 1: [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]}
    whole_driver = PagedDriver(whole.forward, whole.loaded.kv_cache_spec, num_blocks=32)
    staged_driver = PagedDriver(chained, whole.loaded.kv_cache_spec, num_blocks=32)
    for step in (prompts, {0: [11], 1: [12]}):
        expected, got = whole_driver.step(step, all_logits=True), staged_driver.step(step, all_logits=True)
        assert torch.equal(got, expected)


def test_a_later_stage_runs_from_zeros_without_inputs_and_placeholders_refuse_use(tiny_llama):
    last = _load(tiny_llama, ParallelState(pp_rank=1, pp_size=2))
    driver = PagedDriver(last.forward, last.loaded.kv_cache_spec, num_blocks=8)
    assert driver.step({0: [1, 2, 3]}).shape == (1, last.loaded.vocab_size)  # a dummy step (memory profiling)
    placeholder = last.loaded.model.model.layers[0]
    with pytest.raises(AttributeError, match="belongs to another pipeline stage"):
        placeholder.self_attn  # noqa: B018
    with pytest.raises(AttributeError, match="cannot set 'mlp': this module belongs to another pipeline stage"):
        placeholder.mlp = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match="loaded for pipeline stage 1/2, but parallelize was called for 0/2"):
        last.parallelize(ParallelState(pp_rank=0, pp_size=2))
