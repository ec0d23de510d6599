"""The engine on the real SmolLM2-135M-Instruct (fp32, CPU): known answers, batching, streaming."""

from __future__ import annotations

import pytest

from modelrunner import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> LLM:
    return LLM(str(smollm2_dir), device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=64 * 2**20)


def test_known_greedy_answers(smollm2):
    out = smollm2.generate("The capital of France is", SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].text.startswith(" Paris.\n\nThe answer is")
    chat = smollm2.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(max_tokens=32, **GREEDY),
                        use_tqdm=False)[0].outputs[0]
    assert chat.text == "The answer to this classic math problem is 4."
    assert chat.finish_reason == "stop"  # <|im_end|> is EOS
    assert chat.token_ids[-1] == smollm2.get_tokenizer().eos_token_id


def test_batched_equals_alone_and_stream_equals_generate(smollm2):
    prompts = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, ignore_eos=True, **GREEDY)
    alone = [smollm2.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    batched = [o.outputs[0].text for o in smollm2.generate(prompts, params, use_tqdm=False)]
    assert batched == alone
    assert "".join(smollm2.generate_stream(prompts[2], params)) == alone[2]
    assert smollm2.memory_stats()["used_blocks"] == 0
