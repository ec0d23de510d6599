"""What real OpenAI clients send and expect (issue 33, item 4), against one real server on the tiny
Llama: every request field of openai-python accepted (meaningless ones ignored with a debug line,
misspelled ones still refused), a reply's ``model_dump()`` back in the history, 404 for an unknown
model, ``max_tokens`` beyond the context refused at once, CORS with vLLM's options and defaults,
64-bit seeds, ``repetition_penalty`` above 2, and ``/v1/responses`` through ``client.responses``."""

from __future__ import annotations

import json
import threading
import time
import typing

import httpx
import openai
import pytest

from .conftest import TINY_CONFIG, TINY_ENV, ServerProcess

API_KEY = "conformance-key"
MAX_MODEL_LEN = 2048
USER = [{"role": "user", "content": "Tell me about rivers."}]


@pytest.fixture(scope="module")
def server(serve_llama_dir):
    """``modelrunner serve`` on the tiny Llama with an API key, the name "tiny", vLLM's default CORS
    options and debug logging (to see the ignored fields' line)."""
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--api-key", API_KEY,
                          "--served-model-name", "tiny", "--log-level", "debug"], api_key=API_KEY, env=TINY_ENV)
    with proc.serving() as ready:
        yield ready


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _greedy_chat(client, messages, max_tokens: int, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0, **extra)


# -- OpenAI's request fields ---------------------------------------------------------------------


def _typed_dict_keys(union: typing.Any) -> set[str]:
    """Every key of a TypedDict or of each TypedDict in a Union (streamed and not)."""
    members = typing.get_args(union) or (union,)
    return {key for member in members for key in member.__annotations__}


def test_every_field_of_openai_pythons_request_types_is_a_field_of_ours():
    """New fields in a future openai version fail here until they are accepted (or refused) on purpose."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params

    from modelrunner_serve.protocol import ChatCompletionRequest, CompletionRequest
    from modelrunner_serve.responses_api import ResponsesRequest

    for params, model in ((completion_create_params.CompletionCreateParams, CompletionRequest),
                          (chat_create_params.CompletionCreateParams, ChatCompletionRequest),
                          (response_create_params.ResponseCreateParams, ResponsesRequest)):
        keys = _typed_dict_keys(params)
        assert len(keys) > 10
        missing = sorted(keys - set(model.model_fields))
        assert not missing, f"{model.__name__} refuses openai's own fields {missing}"
        assert set(model.ignored_fields) <= set(model.model_fields)


def test_every_message_key_and_stream_option_of_openai_python_is_accepted():
    from openai.types.chat import ChatCompletionMessageParam, ChatCompletionStreamOptionsParam

    from modelrunner_serve.chat import MESSAGE_KEYS
    from modelrunner_serve.protocol import StreamOptions

    assert set(ChatCompletionStreamOptionsParam.__annotations__) <= set(StreamOptions.model_fields)
    assert _typed_dict_keys(ChatCompletionMessageParam) <= MESSAGE_KEYS


def test_openais_own_fields_are_accepted_and_meaningless_ones_logged_once(server, client):
    reply = client.chat.completions.create(
        model="tiny", messages=USER, max_completion_tokens=2, store=True, metadata={"team": "a"},
        service_tier="auto", reasoning_effort="low", verbosity="low", prompt_cache_key="k",
        prompt_cache_retention="24h", safety_identifier="user-1", parallel_tool_calls=False, user="u",
        prediction={"type": "content", "content": "x"}, web_search_options={}, modalities=["text"],
        function_call="none")
    assert reply.choices[0].finish_reason in ("length", "stop")
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, user="u", best_of=1)
    assert completion.choices[0].text is not None
    deadline = time.monotonic() + 5
    while "safety_identifier" not in server.stderr and time.monotonic() < deadline:
        time.sleep(0.05)
    lines = [line for line in server.stderr.splitlines() if "ChatCompletionRequest: ignoring" in line
             and "safety_identifier" in line]
    assert len(lines) == 1, server.stderr  # one line for the request, naming every ignored field
    assert "store, metadata, service_tier, reasoning_effort" in lines[0]  # parallel_tool_calls is used with tools


@pytest.mark.parametrize("extra, param, code", [
    ({"max_tokenz": 3}, "max_tokenz", "unknown_field"),
    ({"parallel_tool_call": True}, "parallel_tool_call", "unknown_field"),
    ({"modalities": ["text", "audio"]}, "modalities", "unsupported"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "unsupported"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "unsupported"),
])
def test_misspelled_fields_are_still_refused_and_unsupported_ones_say_what_is_accepted(client, extra, param,
                                                                                         code):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=USER, max_completion_tokens=2, extra_body=extra)
    assert info.value.param == param and info.value.code == code, info.value.body
    assert param in info.value.message and "accepted" in info.value.message


def test_a_reply_as_model_dump_returns_it_goes_back_into_the_history(client):
    first = _greedy_chat(client, USER, 4)
    dumped = first.choices[0].message.model_dump()
    assert {"annotations", "refusal", "audio", "function_call", "tool_calls"} <= set(dumped)
    history = [*USER, dumped, {"role": "user", "content": "And lakes?"}]
    second = _greedy_chat(client, history, 4)
    plain = _greedy_chat(client, [*USER, {"role": "assistant", "content": first.choices[0].message.content},
                                  {"role": "user", "content": "And lakes?"}], 4)
    assert second.choices[0].message.content == plain.choices[0].message.content
    assert second.usage.prompt_tokens == plain.usage.prompt_tokens
    # A refusal stands in for the content it replaced.
    refused = _greedy_chat(client, [*USER, {"role": "assistant", "content": None, "refusal": "I cannot."},
                                    {"role": "user", "content": "Why?"}], 2)
    spelled = _greedy_chat(client, [*USER, {"role": "assistant", "content": "I cannot."},
                                    {"role": "user", "content": "Why?"}], 2)
    assert refused.usage.prompt_tokens == spelled.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as info:
        _greedy_chat(client, [*USER, {**dumped, "function_call": {"name": "f", "arguments": "{}"}}], 2)
    assert info.value.param == "messages[1].function_call" and info.value.code == "unsupported"


# -- unknown model, max_tokens beyond the context ------------------------------------------------------


def test_an_unknown_model_is_404_model_not_found_on_every_endpoint(server, client):
    calls = [lambda: client.completions.create(model="gpt-4", prompt="Hi", max_tokens=2),
             lambda: client.chat.completions.create(model="gpt-4", messages=USER, max_completion_tokens=2),
             lambda: client.responses.create(model="gpt-4", input="Hi", max_output_tokens=2),
             lambda: client.models.retrieve("gpt-4")]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.code == "model_not_found" and "'tiny'" in info.value.message, info.value.body
    r = server.post("/tokenize", {"model": "gpt-4", "prompt": "Hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_max_tokens_beyond_the_context_is_refused_at_once_naming_the_numbers(server, client):
    prompt_tokens = server.post("/tokenize", {"prompt": "Hi there"}).json()["count"]
    room = MAX_MODEL_LEN - prompt_tokens
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi there", max_tokens=room + 1)
    error = info.value
    assert error.param == "max_tokens" and error.code == "context_length_exceeded", error.body
    assert f"max_tokens is too large: {room + 1}" in error.message
    assert f"{MAX_MODEL_LEN} tokens" in error.message and f"{prompt_tokens} input tokens" in error.message
    assert f"accepted: max_tokens <= {room}" in error.message
    chat_tokens = server.post("/tokenize", {"messages": USER}).json()["count"]
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, **{field: MAX_MODEL_LEN})
        assert info.value.param == field and f"accepted: {field} <= {MAX_MODEL_LEN - chat_tokens}" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=USER, max_output_tokens=MAX_MODEL_LEN)
    assert info.value.param == "max_output_tokens" and info.value.code == "context_length_exceeded"
    assert time.monotonic() - started < 10  # refused, not generated for
    # A prompt that fills the context alone is still the prompt's error.
    r = server.post("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# -- CORS ----------------------------------------------------------------------------------------


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_defaults_are_vllms_and_a_preflight_needs_no_key(server):
    origin = "https://anywhere.example"
    r = httpx.options(server.url + "/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"].lower() == "authorization,content-type"
    assert "access-control-allow-credentials" not in r.headers
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                   headers={"Origin": origin, **server.headers()})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi"}, headers={"Origin": origin})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # errors carry CORS too


class _InThreadServer:
    """The application on uvicorn in a thread, its model never loaded: enough for what CORS answers."""

    def __init__(self, argv: list[str]) -> None:
        import argparse

        import uvicorn

        from modelrunner_serve.app import build_app
        from modelrunner_serve.cli import add_parser, settings_from_args
        from modelrunner_serve.server import bind_socket
        from modelrunner_serve.state import ServerState

        parser = argparse.ArgumentParser()
        add_parser(parser.add_subparsers())
        self.settings = settings_from_args(parser.parse_args(["serve", *argv]))
        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(ServerState(self.settings)), log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> _InThreadServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def test_cors_options_limit_origins_methods_and_headers_as_vllms_do():
    allowed = "https://app.example"
    argv = ["--allowed-origins", json.dumps([allowed]), "--allowed-methods", '["GET", "POST"]',
            "--allowed-headers", "Authorization,Content-Type", "--allow-credentials"]
    with _InThreadServer(argv) as app:
        assert app.settings.allowed_origins == (allowed,) and app.settings.allow_credentials
        r = httpx.options(app.url + "/v1/chat/completions", headers={"Origin": allowed, **PREFLIGHT})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == allowed
        assert r.headers["access-control-allow-credentials"] == "true"
        assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
        for headers in ({"Origin": "https://evil.example", **PREFLIGHT},
                        {"Origin": allowed, **PREFLIGHT, "Access-Control-Request-Method": "DELETE"},
                        {"Origin": allowed, **PREFLIGHT, "Access-Control-Request-Headers": "x-custom"}):
            assert httpx.options(app.url + "/v1/chat/completions", headers=headers).status_code == 400
        r = httpx.get(app.url + "/health", headers={"Origin": allowed})
        assert r.status_code == 503 and r.headers["access-control-allow-origin"] == allowed  # still loading
        assert "access-control-allow-origin" not in httpx.get(app.url + "/health",
                                                              headers={"Origin": "https://evil.example"}).headers


def test_cors_defaults_and_bad_values_on_the_command_line():
    import argparse

    from modelrunner_serve.cli import add_parser, settings_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    settings = settings_from_args(parser.parse_args(["serve"]))
    assert (settings.allowed_origins, settings.allowed_methods, settings.allowed_headers) == (("*",),) * 3
    assert settings.allow_credentials is False
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--allowed-origins", '["a", 5]'])
    from modelrunner_serve.settings import ServeSettings

    with pytest.raises(ValueError, match="allowed-methods must be a list of non-empty strings"):
        ServeSettings(allowed_methods=[""])


# -- seeds and repetition_penalty ------------------------------------------------------------------


def _sampled_ids(client, seed: int) -> list[int]:
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=1.0,
                                    seed=seed, extra_body={"ignore_eos": True, "return_token_ids": True})
    return out.choices[0].model_extra["token_ids"]


def test_seeds_that_differ_only_above_32_bits_sample_differently(client):
    assert _sampled_ids(client, 1) == _sampled_ids(client, 1)
    assert _sampled_ids(client, 1) != _sampled_ids(client, 2**32 + 1)
    assert _sampled_ids(client, 2**63 - 1) != _sampled_ids(client, 2**31 - 1)


def test_repetition_penalty_above_2_is_accepted(client):
    for value in (2.5, 10.0):
        out = client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                        extra_body={"repetition_penalty": value})
        assert out.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("value", [0, -1.5])
def test_repetition_penalty_of_0_or_less_is_a_400_naming_it(client, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"repetition_penalty": value})
    assert info.value.param == "repetition_penalty" and "repetition_penalty" in info.value.message


# -- /v1/responses ---------------------------------------------------------------------------------


def test_responses_create_gives_the_chat_reply_to_the_same_conversation(client):
    chat = _greedy_chat(client, [{"role": "system", "content": "Be brief."}, *USER], 8)
    response = client.responses.create(model="tiny", instructions="Be brief.", input=USER[0]["content"],
                                       max_output_tokens=8, temperature=0)
    assert response.object == "response" and response.id.startswith("resp")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert response.instructions == "Be brief." and response.max_output_tokens == 8 and response.temperature == 0
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    # The output item goes back into the input, as clients keep a conversation.
    follow_up = client.responses.create(
        model="tiny", max_output_tokens=4, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": USER[0]["content"]}]},
               message.model_dump(), {"role": "user", "content": "And lakes?"}])
    again = _greedy_chat(client, [*USER, {"role": "assistant", "content": response.output_text},
                                  {"role": "user", "content": "And lakes?"}], 4)
    assert follow_up.output_text == again.choices[0].message.content


def test_responses_stream_openais_events_in_order(client):
    text = _greedy_chat(client, USER, 12, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1)
                if text[i:i + 2].strip() and text.find(text[i:i + 2]) >= 1)
    events = list(client.responses.create(model="tiny", input=USER, max_output_tokens=12, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True, "stop": [stop]}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed" and final.output_text == deltas == events[-4].text
    assert deltas == text[:text.find(stop)]
    assert final.usage.output_tokens >= 1
    # Cut by max_output_tokens: the stream ends with response.incomplete.
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=3, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.usage.output_tokens == 3


@pytest.mark.parametrize("fields, param, code", [
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "invalid_value"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "unsupported"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "unsupported"),
    ({"max_output_tokenz": 3}, "max_output_tokenz", "unknown_field"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "unsupported"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type",
     "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
])
def test_responses_refuse_what_they_do_not_do_yet_naming_the_field(client, fields, param, code):
    body = {"input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", **{k: v for k, v in body.items() if k != "max_output_tokenz"},
                                extra_body={k: v for k, v in body.items() if k == "max_output_tokenz"})
    assert info.value.param == param and info.value.code == code, info.value.body
    if code == "unsupported" and "." not in param and "[" not in param:
        assert "accepted" in info.value.message
