"""``LLM.embed`` / ``LLM.encode``: vLLM's offline embedding API, checked against transformers' and
sentence-transformers' own hidden states, on the llama adapter, the generic transformers adapter
(a Qwen3-Embedding-style checkpoint), pipeline stages and the default GGUF model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelrunner import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from modelrunner_kit.conformance.models import reference_model
from modelrunner.errors import UnknownNameError

from .conftest import EMBED_CONFIG, MATRYOSHKA

LONG = [1] + [3 + (7 * i) % 250 for i in range(59)]
"""A 60-token prompt (token ids), prefilled in four chunks under a 16-token budget."""


def hidden_states(reference, ids: list[int]) -> torch.Tensor:
    """transformers' final hidden states (after the final norm) of one prompt: ``[len(ids), hidden]``."""
    with torch.no_grad():
        return reference.model(torch.tensor([ids])).last_hidden_state[0].float()


@pytest.fixture(scope="module")
def llama(llama_dir):
    return LLM(str(llama_dir), max_num_batched_tokens=16, max_model_len=128, **EMBED_CONFIG)


@pytest.fixture(scope="module")
def llama_reference(llama_dir):
    return reference_model(llama_dir)


def test_embed_returns_vllm_shaped_normalised_last_token_states(llama, llama_reference):
    prompts = ["t5 t6 t7", [1, 9, 8, 7, 6], {"prompt_token_ids": LONG}]
    outs = llama.embed(prompts, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished and o.finish_reason == "stop" for o in outs)
    assert [o.outputs.hidden_size for o in outs] == [64, 64, 64]
    assert outs[1].prompt_token_ids == [1, 9, 8, 7, 6] and outs[2].prompt_token_ids == LONG
    for out in outs:
        want = F.normalize(hidden_states(llama_reference, out.prompt_token_ids)[-1], dim=-1)
        assert torch.allclose(torch.tensor(out.outputs.embedding), want, atol=1e-5)
    assert llama.memory_stats()["used_blocks"] == 0


def test_token_embed_truncation_and_lengths(llama, llama_reference):
    out = llama.encode([LONG], PoolingParams(normalize=False), pooling_task="token_embed", use_tqdm=False)[0]
    assert torch.allclose(out.outputs.data, hidden_states(llama_reference, LONG), atol=1e-4)
    cut = llama.encode([LONG], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert cut.prompt_token_ids == LONG[-5:]
    full = [1] + [5] * 127  # exactly max_model_len: fine for an embedding (nothing is generated) ...
    assert llama.embed([full], use_tqdm=False)[0].outputs.hidden_size == 64
    with pytest.raises(ValueError, match="leaves no room for output"):  # ... but not for generation
        llama.generate([full], SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt 1: .*prompt has 129 tokens but max_model_len is 128; accepted: at "
                                         r"most 128 tokens \(or set truncate_prompt_tokens\)"):
        llama.embed([[1, 2], full + [5]], use_tqdm=False)
    assert llama.llm_engine.get_num_unfinished_requests() == 0  # prompt 0 was not left queued


def test_bad_pooling_params_are_refused_naming_the_field(llama):
    with pytest.raises(ValueError, match=r"prompt 0: dimensions: model .* does not support Matryoshka"):
        llama.embed("t5", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    for params, field in ((PoolingParams(dimensions=0), "dimensions"), (PoolingParams(normalize="yes"), "normalize"),
                          (PoolingParams(task="classify"), "task")):
        with pytest.raises(ValueError, match=f"prompt 0: {field} must be"):
            llama.encode("t5", params, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params must be PoolingParams"):
        llama.encode("t5", SamplingParams(), use_tqdm=False)


def test_chunked_preempted_pooling_beside_generation_matches_transformers(llama_dir, llama_reference):
    # A cache of 6 blocks of 16 tokens. A generating request (40-token prompt, 20 new tokens) keeps
    # growing while two 60-token embedding prompts are prefilled in chunks of the 16-token budget:
    # they cannot all hold their blocks, so the embedding prompts are preempted and computed again
    # (partly from their own cached blocks). Every embedding still equals transformers' states of the
    # rows its method reads, and the generating request produces what it does alone.
    second = [1] + [200 - i for i in range(59)]
    generating = [1] + [10 + i for i in range(39)]
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for method, rows in (("mean", slice(None)), ("cls", slice(0, 1)), ("last", slice(-1, None))):
        llm = LLM(str(llama_dir), pooling_type=method, max_num_batched_tokens=16, max_model_len=96, **{
            **EMBED_CONFIG, "kv_cache_memory": 6 * 16 * 512})
        alone = llm.generate([generating], free, use_tqdm=False)[0].outputs[0].token_ids
        engine, done = llm.llm_engine, {}
        engine.add_request("free", generating, free, on_output=engine.collect(done))
        for i, prompt in enumerate((LONG, second)):
            engine.add_request(f"pool-{i}", prompt, PoolingParams(normalize=False), on_output=engine.collect(done))
        while len(done) < 3:
            engine.advance()
        assert engine.scheduler.num_preemptions > 0, method
        assert done["free"].outputs[0].token_ids == alone
        for i, prompt in enumerate((LONG, second)):
            want = hidden_states(llama_reference, prompt)[rows].mean(0)
            assert torch.allclose(done[f"pool-{i}"].outputs.data, want, atol=1e-4), (method, i)


def test_pooling_type_is_checked_at_start_and_accepts_vllms_spelling(llama_dir):
    with pytest.raises(UnknownNameError, match=r"pooling method 'maxx' \(from the pooling_type config field\): "
                                               r"unknown pooling method 'maxx'; installed: cls, last, mean"):
        LLM(str(llama_dir), pooling_type="maxx", **EMBED_CONFIG)
    llm = LLM(str(llama_dir), pooler_config={"pooling_type": "MEAN", "normalize": False}, **EMBED_CONFIG)
    assert (llm.llm_engine.pooler.method_name, llm.llm_engine.pooler.normalize) == ("mean", False)


def test_qwen3_embedding_checkpoint_matches_sentence_transformers(qwen3_embedding_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(qwen3_embedding_dir), device="cpu")
    llm = LLM(str(qwen3_embedding_dir), max_num_batched_tokens=4, **EMBED_CONFIG)  # chunks of 4 tokens
    assert llm.runner.loaded.adapter == "default-transformers"  # no native adapter for Qwen3ForCausalLM
    pooler = llm.llm_engine.pooler
    assert (pooler.method_name, pooler.normalize) == ("last", True)  # read from its modules.json
    texts = ["t5 t6 t7 t8 t9", "t3", "t7 t7 t7 t4 t5 t6 t8 t9 t3 t4 t5"]
    want = st.encode(texts, convert_to_tensor=True)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert (got - want).abs().max() <= 1e-4
    for dims in MATRYOSHKA[:2]:
        short = llm.embed(texts, pooling_params=PoolingParams(dimensions=dims), use_tqdm=False)
        st_short = F.normalize(st.encode(texts, convert_to_tensor=True, truncate_dim=dims), dim=-1)
        assert (torch.tensor([o.outputs.embedding for o in short]) - st_short).abs().max() <= 1e-4
    with pytest.raises(ValueError, match="supports the Matryoshka dimensions 16, 32, 64 only, got 10"):
        llm.embed(texts, pooling_params=PoolingParams(dimensions=10), use_tqdm=False)


def test_bert_encoder_matches_sentence_transformers_one_prompt_per_step(bert_dir):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(bert_dir), device="cpu")
    # A 16-token budget: each prompt fits a step but two do not, and an encoder's prompt is never chunked.
    llm = LLM(str(bert_dir), max_num_batched_tokens=16, **EMBED_CONFIG)
    assert (llm.runner.loaded.adapter, llm.runner.loaded.causal) == ("default-transformers", False)
    assert (llm.llm_engine.pooler.method_name, llm.llm_engine.pooler.normalize) == ("mean", True)
    texts = ["t5 t6 t7 t8 t9 t3 t4 t5 t6", "t3 t4", "t9 t8 t7 t6 t5 t4 t3 t9 t8 t7 t6"]
    got = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert (got - st.encode(texts, convert_to_tensor=True)).abs().max() <= 1e-4
    with pytest.raises(ValueError, match=r"prompt has 20 tokens; model .* is an encoder .* at most "
                                         r"max_num_batched_tokens=16 tokens"):
        llm.embed([[5] * 20], use_tqdm=False)
    with pytest.raises(ValueError, match="is an encoder .* it computes embeddings .* not generations"):
        llm.generate("t5 t6", use_tqdm=False)


def test_pipeline_stages_return_the_last_stages_hidden_states(llama_dir):
    prompts = [[1, 5, 9, 11], LONG]
    one = LLM(str(llama_dir), pooling_type="mean", **EMBED_CONFIG)
    staged = LLM(str(llama_dir), pooling_type="mean", pipeline_parallel_size=2, **EMBED_CONFIG)
    try:
        got = [o.outputs.embedding for o in staged.embed(prompts, use_tqdm=False)]
    finally:
        staged.shutdown()
    want = [o.outputs.embedding for o in one.embed(prompts, use_tqdm=False)]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-6)


def test_pooler_refuses_a_step_without_hidden_states(llama):
    from modelrunner.forward_batch import ForwardOutput

    owners = [(object(), [0, 1])]
    with pytest.raises(ValueError, match=r"adapter 'x' returned none for aux\['hidden_states'\] where 2 rows were "
                                         r"asked .* it cannot serve embeddings"):
        llama.llm_engine.pooler.collect(ForwardOutput(logits=torch.zeros(0, 4)), owners, "x")


@pytest.mark.slow
def test_default_gguf_model_embeds_its_final_hidden_states():
    llm = LLM("smollm2", device="cpu", max_model_len=256, kv_cache_memory=32 << 20, compile=False)
    texts = ["The capital of France is Paris.", "Paris is the capital of France.", "def fibonacci(n):"]
    outs = llm.embed(texts, use_tqdm=False)
    vectors = torch.tensor([o.outputs.embedding for o in outs])
    assert vectors.shape == (3, 576) and torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-5)
    similarity = vectors @ vectors.T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[1, 2]
    # The raw (unnormalised) vector is the final hidden state the model's own logits come from.
    raw = llm.encode(texts[2], PoolingParams(normalize=False), use_tqdm=False)[0]
    logits = llm.runner.forward(raw.prompt_token_ids)[0, -1]
    with torch.no_grad():
        from_hidden = llm.runner.loaded.model.compute_logits(raw.outputs.data[None]).float()[0]
    assert (from_hidden - logits).abs().max() <= 1e-3 * logits.abs().max()
