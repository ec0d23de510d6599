"""``POST /v1/embeddings`` through the real ``openai`` client (``client.embeddings.create``) and raw
HTTP: every ``input`` form, both encodings, ``dimensions``, usage, and 400s that name the field. The
served checkpoint is the tiny Qwen3-Embedding-style one, checked against sentence-transformers."""

from __future__ import annotations

import asyncio
import base64
import re

import numpy as np
import openai
import pytest
import torch

from serve.conftest import TINY_ENV, ServerProcess

from .conftest import MATRYOSHKA

TEXTS = ["t5 t6 t7 t8 t9", "t3", "t7 t7 t7 t4 t5 t6 t8 t9 t3 t4 t5"]
MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def server(qwen3_embedding_dir):
    proc = ServerProcess(["--model", str(qwen3_embedding_dir), "--served-model-name", MODEL, "--set", "dtype=float32",
                          "--set", "kv_cache_memory=8388608", "--set", "max_num_batched_tokens=8"], env=TINY_ENV)
    with proc.serving() as ready:
        yield ready


@pytest.fixture(scope="module")
def reference(qwen3_embedding_dir):
    """sentence-transformers' embeddings of :data:`TEXTS` (full size and each Matryoshka size)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(qwen3_embedding_dir), device="cpu")
    return {dims: torch.nn.functional.normalize(st.encode(TEXTS, convert_to_tensor=True, truncate_dim=dims), dim=-1)
            for dims in MATRYOSHKA}


def test_openai_client_embeddings_match_sentence_transformers(server, reference):
    client = server.client()
    result = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert result.model == MODEL and [d.index for d in result.data] == [0, 1, 2]
    got = torch.tensor([d.embedding for d in result.data])
    assert (got - reference[64]).abs().max() <= 1e-4
    counts = [len(server.post("/tokenize", {"prompt": t}).json()["tokens"]) for t in TEXTS]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(counts)
    short = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=16, encoding_format="float")
    assert (torch.tensor([d.embedding for d in short.data]) - reference[16]).abs().max() <= 1e-4
    with pytest.raises(openai.BadRequestError, match="Matryoshka dimensions 16, 32, 64 only, got 10"):
        client.embeddings.create(model=MODEL, input="t5", dimensions=10)


def test_input_forms_and_encodings(server):
    def post(**body):
        response = server.post("/v1/embeddings", {"model": MODEL, **body})
        assert response.status_code == 200, response.text
        return response.json()

    floats = post(input=TEXTS[0], encoding_format="float")
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    vector = floats["data"][0]["embedding"]
    packed = post(input=TEXTS[0], encoding_format="base64")["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="<f4").tolist() == pytest.approx(vector, abs=0)
    ids = server.post("/tokenize", {"prompt": TEXTS[0]}).json()["tokens"]
    assert post(input=ids)["data"][0]["embedding"] == vector  # one prompt as token ids
    both = post(input=[ids, ids[:2]])
    assert [d["index"] for d in both["data"]] == [0, 1] and both["data"][0]["embedding"] == vector
    assert both["usage"] == {"prompt_tokens": len(ids) + 2, "total_tokens": len(ids) + 2}
    named = post(input=TEXTS[0], request_id="abc", priority=0, embed_dtype="float32", endianness="little")
    assert named["id"] == "embd-abc" and named["data"][0]["embedding"] == vector
    raw = post(input=TEXTS[0], normalize=False, truncate_prompt_tokens=2)
    assert raw["usage"]["prompt_tokens"] == 2 and abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1) > 1e-3


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"input": ""}, 400, "input", "input is empty"),
    ({"input": []}, 400, "input", "input is empty"),
    ({"input": ["t5", ""]}, 400, "input[1]", r"input\[1\] is empty"),
    ({"input": [[5], []]}, 400, "input[1]", r"input\[1\] is empty"),
    ({"input": ["t5", [5]]}, 400, "input", "mixes strings and token-id lists"),
    ({"input": 5}, 400, "input", "input must be a string, a list of strings, a list of token ids"),
    ({}, 400, "input", "input is required"),
    ({"input": [[5], [5, 9999]]}, 400, "input[1]", r"input\[1\]: prompt token id 9999 is not in the vocabulary"),
    ({"input": " ".join(["t5"] * 300)}, 400, "input", "input has 300 tokens but max_model_len is 256"),
    ({"input": "t5", "dimensions": 10}, 400, "dimensions", "supports the Matryoshka dimensions 16, 32, 64 only"),
    ({"input": "t5", "dimensions": 0}, 400, "dimensions", "dimensions must be a positive integer"),
    ({"input": "t5", "encoding_format": "hex"}, 400, "encoding_format", "must be one of float, base64"),
    ({"input": "t5", "dimension": 16}, 400, "dimension", "dimension"),
    ({"input": "t5", "model": "other"}, 404, "model", "model 'other' is not served here"),
    ({"input": "t5", "priority": 1}, 400, "priority", "priority is not supported .* accepted: 0"),
    ({"input": "t5", "embed_dtype": "float16"}, 400, "embed_dtype", "accepted: float32"),
    ({"input": "t5", "request_id": ""}, 400, "request_id", "non-empty string"),
])
def test_errors_name_the_field(server, body, status, param, message):
    response = server.post("/v1/embeddings", {"model": MODEL, **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert re.search(message, error["message"]), error["message"]


def test_embeddings_batch_with_completions_on_one_engine(server):
    async def run():
        client = server.async_client()
        alone = (await client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")).data[0].embedding
        completion = client.completions.create(model=MODEL, prompt="t5 t6", max_tokens=12, temperature=0)
        embeddings = [client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float") for _ in range(6)]
        done = await asyncio.gather(completion, *embeddings)
        assert done[0].choices[0].finish_reason in ("length", "stop")
        for result in done[1:]:
            assert result.data[0].embedding == pytest.approx(alone, abs=1e-6)

    asyncio.run(run())
    assert server.metrics()["modelrunner:request_success_total{finished_reason=stop}"] >= 6


def test_every_field_of_openais_embedding_request_is_accepted():
    from openai.types import embedding_create_params

    from modelrunner_serve.embeddings import EmbeddingRequest

    openai_fields = set(embedding_create_params.EmbeddingCreateParams.__annotations__)
    assert openai_fields <= set(EmbeddingRequest.model_fields), openai_fields - set(EmbeddingRequest.model_fields)
