"""Images in chat messages (base64 data: URLs) on the tiny LLaVA: the same tokens as the offline API
with the same image, and bad images refused with 400 naming the part."""

from __future__ import annotations

import base64
import io

import pytest

from .conftest import TINY_ENV, ServerProcess

CONFIG = dict(dtype="float32", max_model_len=256, kv_cache_memory=4 << 20)


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, serve_tokenizer_dir):
    from mm.checkpoint import save_tiny_llava

    path = tmp_path_factory.mktemp("serve-llava")
    save_tiny_llava(path, serve_tokenizer_dir)
    return path


@pytest.fixture(scope="module")
def server(llava_dir):
    args = [a for key, value in CONFIG.items() for a in ("--set", f"{key}={value}")]
    proc = ServerProcess(["--model", str(llava_dir), *args], env=TINY_ENV)
    try:
        yield proc.wait_ready()
    finally:
        assert proc.stop() == 0, proc.stderr


def _data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def test_an_image_data_url_gives_the_offline_tokens(server, llava_dir):
    from mm.checkpoint import random_image
    from modelrunner import LLM, SamplingParams

    image = random_image(1)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(image)}},
                                             {"type": "text", "text": "What is shown here?"}]}]
    out = server.client().chat.completions.create(model=str(llava_dir), messages=messages, max_tokens=8,
                                                  temperature=0, extra_body={"ignore_eos": True,
                                                                             "return_token_ids": True})
    llm = LLM(str(llava_dir), **CONFIG)
    prompt = llm.chat_prompt([{"role": "user", "content": "<image>\nWhat is shown here?"}])
    ref = llm.generate({**prompt, "images": [image]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.choices[0].model_extra["token_ids"] == ref.outputs[0].token_ids
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)  # placeholders expanded to the image's tokens


@pytest.mark.parametrize("url, param, words", [
    ("data:image/png;base64,iVBORw0KGgo=", "messages[0].content[0].image_url.url", "not an image"),
    ("data:image/png;base64,%%%", "messages[0].content[0].image_url.url", "base64"),
    ("data:text/plain;base64,aGk=", "messages[0].content[0].image_url.url", "not an image"),
    ("https://example.com/cat.png", "messages[0].content[0].image_url.url", "fetches no URLs"),
])
def test_a_bad_image_gets_400_naming_the_part(server, url, param, words):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Hi"}]}]
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.text
    ok = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_more_placeholders_than_images_gets_400(server):
    from mm.checkpoint import random_image

    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(random_image(2))}},
                                             {"type": "text", "text": "and <image> too"}]}]
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "placeholder" in r.json()["error"]["message"]
