"""What real clients send and expect, part 2 (issue 53 items 2-6, issue 52 items 5-6), against one real
server on the tiny Llama with ``--enable-auto-tool-choice --tool-call-parser hermes``: vLLM's own
request fields accepted (honoured, or refused only for values this server cannot honour), history
messages with other clients' extra keys, a forced or ``auto`` call cut by ``max_tokens`` that leaks no
markup, continuous usage from the first chunk, constraints that cannot be honoured refused with a 400
naming the field, and tools whose parameters use nested pydantic models. The client libraries
themselves (openai-agents, litellm, LangChain) run against the real SmolLM2 server in
``test_serve_structured.py``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import TINY_CONFIG, TINY_ENV, ServerProcess

USER = [{"role": "user", "content": "Tell me about rivers."}]
ZONE = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
HERMES_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'

# vLLM's request fields (vllm/entrypoints/openai/protocol.py, ChatCompletionRequest and
# CompletionRequest, 0.9 … 0.11: the union, so clients written for older or newer versions both work).
VLLM_SHARED = ("model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
               "response_format", "seed", "stop", "stream", "stream_options", "temperature", "top_p", "user",
               "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
               "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
               "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
               "add_special_tokens", "structured_outputs", "priority", "request_id", "logits_processors",
               "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
               "guided_decoding_backend", "guided_whitespace_pattern", "best_of", "echo")
VLLM_CHAT = VLLM_SHARED + ("messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice",
                           "reasoning_effort", "include_reasoning", "parallel_tool_calls", "bad_words",
                           "add_generation_prompt", "continue_final_message", "documents", "chat_template",
                           "chat_template_kwargs", "mm_processor_kwargs")
VLLM_COMPLETION = VLLM_SHARED + ("prompt", "suffix", "prompt_embeds")
# Each at vLLM's default: a request naming them all must be answered as if it named none.
VLLM_DEFAULTS = {"use_beam_search": False, "length_penalty": 1.0, "stop_token_ids": [],
                 "include_stop_str_in_output": False, "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
                 "spaces_between_special_tokens": True, "priority": 0, "return_tokens_as_token_ids": False,
                 "return_token_ids": False, "kv_transfer_params": None, "vllm_xargs": None, "structural_tag": None,
                 "guided_decoding_backend": None, "guided_whitespace_pattern": None, "logits_processors": None,
                 "allowed_token_ids": None, "truncate_prompt_tokens": None, "prompt_logprobs": None}
CHAT_DEFAULTS = {**VLLM_DEFAULTS, "echo": False, "add_generation_prompt": True, "continue_final_message": False,
                 "add_special_tokens": False, "documents": None, "mm_processor_kwargs": None, "include_reasoning": True,
                 "bad_words": []}
COMPLETION_DEFAULTS = {**VLLM_DEFAULTS, "add_special_tokens": True, "prompt_embeds": None}
DOCUMENTS_TEMPLATE = ("{% for d in documents or [] %}[doc] {{ d.title }}: {{ d.text }}\n{% endfor %}"
                      "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


@pytest.fixture(scope="module")
def server(serve_llama_dir):
    """``modelrunner serve`` on the tiny Llama, the name "tiny", hermes tool calls, request templates."""
    proc = ServerProcess(["--model", str(serve_llama_dir), *TINY_CONFIG, "--served-model-name", "tiny",
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--trust-request-chat-template"], env=TINY_ENV)
    with proc.serving() as ready:
        yield ready


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, messages=USER, max_tokens: int = 4, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0, **extra)


def _refused(call, param: str, code: str | None = None) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.param == param, info.value.body
    if code is not None:
        assert info.value.code == code, info.value.body
    return info.value


def _events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# -- vLLM's request fields (item 3) --------------------------------------------------------------


def test_every_request_field_of_vllms_server_is_a_field_of_ours():
    from modelrunner_serve.protocol import ChatCompletionRequest, CompletionRequest

    for fields, model in ((VLLM_CHAT, ChatCompletionRequest), (VLLM_COMPLETION, CompletionRequest)):
        missing = sorted(set(fields) - set(model.model_fields))
        assert not missing, f"{model.__name__} refuses vLLM's own fields {missing}"


def test_vllms_fields_at_their_defaults_change_nothing(client):
    plain = _chat(client, max_tokens=6)
    named = _chat(client, max_tokens=6, extra_body=CHAT_DEFAULTS)
    assert named.choices[0].message.content == plain.choices[0].message.content
    completion = client.completions.create(model="tiny", prompt="Rivers", max_tokens=6, temperature=0)
    again = client.completions.create(model="tiny", prompt="Rivers", max_tokens=6, temperature=0,
                                      extra_body=COMPLETION_DEFAULTS)
    assert again.choices[0].text == completion.choices[0].text
    # guided_decoding_backend and guided_whitespace_pattern tune a constraint: without one, nothing to do
    bare = _chat(client, max_tokens=6, extra_body={"guided_decoding_backend": "xgrammar",
                                                   "guided_whitespace_pattern": " ?"})
    assert bare.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"priority": 1}, "priority"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"structural_tag": '{"structures": []}'}, "structural_tag"),
    ({"mm_processor_kwargs": {"num_crops": 4}}, "mm_processor_kwargs"),
    ({"best_of": 3}, "best_of"),
])
def test_vllm_values_this_server_cannot_honour_are_400s_saying_what_is_accepted(client, extra, param):
    error = _refused(lambda: _chat(client, extra_body=extra), param, "unsupported")
    assert "accepted" in error.message


def test_prompt_embeds_on_completions_is_refused_naming_it(client):
    _refused(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                               extra_body={"prompt_embeds": "AAAA"}), "prompt_embeds", "unsupported")


def test_request_id_names_the_response_and_may_repeat(client):
    chat = _chat(client, extra_body={"request_id": "trace-42"})
    assert chat.id == "chatcmpl-trace-42"
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=2,
                                           extra_body={"request_id": "trace-42"})
    assert completion.id == "cmpl-trace-42"
    _refused(lambda: _chat(client, extra_body={"request_id": ""}), "request_id")


def test_cache_salt_keeps_prefix_cache_blocks_apart(client):
    prompt = " ".join(f"river{i}" for i in range(60))  # several full blocks

    def cached(**extra) -> int:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return out.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0  # the same prompt again: its blocks are shared
    assert cached(cache_salt="tenant-a") == 0  # a salt shares nothing with the unsalted prompt …
    assert cached(cache_salt="tenant-a") > 0  # … but with the same salt
    assert cached(cache_salt="tenant-b") == 0
    _refused(lambda: cached(cache_salt=""), "cache_salt")


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    chat = _chat(client, logprobs=True, top_logprobs=2, extra_body={"return_tokens_as_token_ids": True,
                                                                    "return_token_ids": True})
    ids = chat.choices[0].model_extra["token_ids"]
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(top.token.startswith("token_id:") for e in chat.choices[0].logprobs.content for top in e.top_logprobs)
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=0, logprobs=1,
                                           extra_body={"return_tokens_as_token_ids": True})
    assert all(re.fullmatch(r"token_id:\d+", t) for t in completion.choices[0].logprobs.tokens)


def test_vllm_xargs_is_extra_args_and_both_at_once_are_refused(client):
    assert _chat(client, extra_body={"vllm_xargs": {"tag": "a", "n": [1, 2]}}).choices[0].finish_reason
    _refused(lambda: _chat(client, extra_body={"vllm_xargs": {"a": 1}, "extra_args": {"a": 1}}), "vllm_xargs")


def test_documents_reach_the_chat_template(client):
    docs = [{"title": "Nile", "text": "The Nile is long."}]
    without = _chat(client, extra_body={"chat_template": DOCUMENTS_TEMPLATE})
    with_docs = _chat(client, extra_body={"chat_template": DOCUMENTS_TEMPLATE, "documents": docs})
    assert with_docs.usage.prompt_tokens > without.usage.prompt_tokens + 5


def test_chat_echo_puts_the_continued_message_before_the_reply(server, client):
    messages = [*USER, {"role": "assistant", "content": "Rivers are"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    plain = _chat(client, messages, 4, extra_body=extra).choices[0].message.content
    echoed = _chat(client, messages, 4, extra_body={**extra, "echo": True}).choices[0].message.content
    assert echoed == "Rivers are" + plain
    chunks = _events(server, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4,
                                                      "temperature": 0, "stream": True, "echo": True, **extra})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == echoed


# -- history messages with other clients' keys (item 2) -------------------------------------------


def test_unknown_keys_in_history_messages_are_ignored_as_vllm_ignores_them(client):
    litellm_style = {"role": "assistant", "content": "Rivers flow.", "tool_calls": None, "function_call": None,
                     "provider_specific_fields": {"refusal": None}, "reasoning_content": "They do.",
                     "thinking_blocks": None}
    history = [*USER, litellm_style, {"role": "user", "content": "And lakes?", "cache_control": {"type": "x"}}]
    plain = [*USER, {"role": "assistant", "content": "Rivers flow."}, {"role": "user", "content": "And lakes?"}]
    assert _chat(client, history).choices[0].message.content == _chat(client, plain).choices[0].message.content


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": "x", "name": 5}, "messages[1].name"),
    ({"role": "assistant", "content": "x", "reasoning_content": ["a"]}, "messages[1].reasoning_content"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "1"}}, "messages[1].tool_calls"),
    ({"role": "tool", "content": "x", "tool_call_id": 7}, "messages[1].tool_call_id"),
    ({"role": "robot", "content": "x"}, "messages[1].role"),
])
def test_known_message_keys_of_the_wrong_type_are_still_400s(client, message, param):
    _refused(lambda: _chat(client, [*USER, message]), param)


# -- calls cut by max_tokens (item 4) ------------------------------------------------------------


def test_a_forced_call_cut_by_max_tokens_leaks_no_json(server, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    cut = _chat(client, max_tokens=3, tools=[ZONE], tool_choice=named)
    choice = cut.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    chunks = _events(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 3,
                                                      "temperature": 0, "stream": True, "tools": [ZONE],
                                                      "tool_choice": named})
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not "".join(d["delta"].get("content") or "" for d in deltas)
    assert deltas[-1]["finish_reason"] == "length" and not any("tool_calls" in d["delta"] for d in deltas)


def test_an_auto_call_cut_by_max_tokens_leaves_no_markup_in_content(server, client):
    # The regex makes the tiny model write a hermes call after some text; max_tokens cuts it.
    regex = "Checking\\. " + re.escape(HERMES_CALL)
    kwargs = {"tools": [ZONE], "extra_body": {"guided_regex": regex}}
    whole = _chat(client, max_tokens=60, **kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    cut = _chat(client, max_tokens=8, **kwargs).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == "Checking." and not cut.message.tool_calls
    chunks = _events(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 8,
                                                      "temperature": 0, "stream": True, "tools": [ZONE],
                                                      "guided_regex": regex})
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert content.strip() == "Checking." and "<tool" not in content


# -- usage from the first chunk (item 6) ---------------------------------------------------------


def test_continuous_usage_stats_start_with_the_role_chunk(server):
    chunks = _events(server, "/v1/chat/completions", {
        "model": "tiny", "messages": USER, "max_tokens": 3, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    first = chunks[0]["usage"]
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 0
    assert first["total_tokens"] == first["prompt_tokens"]
    assert all(c["usage"]["prompt_tokens"] == first["prompt_tokens"] for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3


# -- constraints that cannot be honoured (item 5; issue 52 item 5) -------------------------------


def _schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("extra, param, code, named", [
    ({"extra_body": {"guided_regex": "a[^\\s\\S]"}}, "guided_regex", "invalid_value", "matches no text"),
    ({"extra_body": {"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]+"}}}, "structured_outputs",
     "invalid_value", "matches no text"),
    ({"extra_body": {"guided_grammar": 'root ::= a\na ::= "x" a'}}, "guided_grammar", "invalid_value",
     "matches no text"),
    (_schema({"$ref": "#"}), "response_format", "invalid_value", "$ref '#'"),
    (_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     "response_format", "invalid_value", "#/$defs/a"),
    (_schema({"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}), "response_format",
     "unsupported", "never fetched"),
    (_schema({"type": "object", "properties": {"a": {"$ref": "file:///etc/passwd"}}}), "response_format",
     "unsupported", "file:///etc/passwd"),
    (_schema({"type": "string", "const": 5}), "response_format", "invalid_value", "const 5"),
    (_schema({"anyOf": []}), "response_format", "invalid_value", "anyOf is an empty list"),
    ({"extra_body": {"guided_json": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}},
     "guided_json", "invalid_value", "#/properties/a"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "https://example.com/a.json"}}}}}], "tool_choice": "required"}, "tools", "unsupported",
     "never fetched"),
])
def test_constraints_that_cannot_be_honoured_are_400s_naming_the_field(client, extra, param, code, named):
    error = _refused(lambda: _chat(client, **extra), param, code)
    assert named in error.message, error.message
    assert _chat(client).choices[0].finish_reason  # and the server keeps serving


def test_completions_refuse_them_too(client):
    _refused(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                               extra_body={"guided_regex": "[^\\s\\S]"}),
             "guided_regex", "invalid_value")


# -- tools with nested pydantic models (issue 52 item 6) -----------------------------------------


class Address(BaseModel):
    city: str = Field(max_length=6)
    zone: int = Field(ge=0, le=9)


class Person(BaseModel):
    name: str = Field(max_length=6)
    home: Address


def test_tools_with_nested_models_give_calls_that_validate(client):
    person = {"type": "function", "function": {"name": "save_person", "parameters": Person.model_json_schema()}}
    assert "$defs" in person["function"]["parameters"]
    for choice in ({"type": "function", "function": {"name": "save_person"}}, "required"):
        reply = _chat(client, max_tokens=120, tools=[person, ZONE], tool_choice=choice,
                      parallel_tool_calls=False)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
        call = message.tool_calls[0].function
        arguments = json.loads(call.arguments)
        jsonschema.validate(arguments, {"save_person": person, "get_time": ZONE}[call.name]["function"]["parameters"])
        if call.name == "save_person":
            Person.model_validate(arguments)
    # The same schema as a constraint of the answer works as it always did (compact: a random model
    # would otherwise wander in whitespace).
    answer = _chat(client, max_tokens=120, extra_body={"structured_outputs": {
        "json": Person.model_json_schema(), "disable_any_whitespace": True}})
    Person.model_validate_json(answer.choices[0].message.content)
