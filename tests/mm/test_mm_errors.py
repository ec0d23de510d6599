"""Bad image requests fail alone, with a message naming what is wrong; the engine keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from modelrunner import SamplingParams
from modelrunner.llm import LLM

from .checkpoint import random_image

SHORT = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.mark.parametrize(("prompt", "match"), [
    ({"prompt": "<image> and <image>", "images": [random_image(0)]},
     r"prompt has 2 image placeholder\(s\) \('<image>', token id \d+\) but 1 image\(s\) were given"),
    ({"prompt": "no placeholder here", "images": [random_image(0)]}, r"0 image placeholder\(s\).* 1 image\(s\)"),
    ({"prompt": "a placeholder <image> but no image"}, r"1 image placeholder\(s\).* 0 image\(s\)"),
    ({"prompt": "<image>", "images": ["photo.png"]}, r"images\[0\] is str; accepted: PIL.Image.Image"),
    ({"prompt": "<image>", "images": [np.zeros((4, 4))]}, r"images\[0\] is a 2-d ndarray"),
    ({"prompt": "<image>", "images": random_image(0).tobytes()}, r"'images' must be a list of images, got bytes"),
])
def test_bad_request_fails_alone(llava_llm, prompt, match):
    engine = llava_llm.engine
    engine.add_request("good", {"prompt": "USER: <image> ASSISTANT:", "images": [random_image(5)]}, SHORT)
    with pytest.raises(ValueError, match=match) as err:
        engine.add_request("bad", prompt, SHORT)
    assert "request 'bad'" in str(err.value)
    done = engine.run_until_finished(["good"])
    assert done["good"].error is None and len(done["good"].outputs[0].token_ids) == 3
    assert not engine.has_unfinished_requests()


def test_generate_names_the_bad_prompt_and_runs_the_next_call(llava_llm):
    good = {"prompt": "<image> is", "images": [random_image(6)]}
    with pytest.raises(ValueError, match=r"prompt 1: request '[^']+': the prompt has 2 image placeholder"):
        llava_llm.generate([good, {"prompt": "<image><image>", "images": [random_image(7)]}], SHORT, use_tqdm=False)
    assert not llava_llm.engine.has_unfinished_requests()  # the good one was withdrawn with the call
    assert llava_llm.generate(good, SHORT, use_tqdm=False)[0].error is None


def test_image_for_a_text_only_model_is_refused(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=64, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match=r"model 'LlamaForCausalLM' \(adapter 'llama'\) takes no images"):
        llm.generate({"prompt": "What is this?", "images": [random_image(8)]}, SHORT, use_tqdm=False)
    assert llm.generate("What is this?", SHORT, use_tqdm=False)[0].error is None
    assert llm.generate({"prompt": "What is this?", "images": []}, SHORT, use_tqdm=False)[0].error is None
