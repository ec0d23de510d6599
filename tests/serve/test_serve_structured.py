"""Structured outputs and tool calls through real clients against one server on the default model
(SmolLM2-135M-Instruct, whose chat template has no tool support) started with
``--enable-auto-tool-choice --tool-call-parser hermes`` (issue 33, item 3), and the client libraries
that expect exactly one call for a named function: instructor's way (with the openai client:
instructor pins a jiter older than openai's), openai-agents, litellm and LangChain (issue 53, issue 52
item 6)."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .conftest import ServerProcess

pytestmark = pytest.mark.slow

CONFIG = dict(max_model_len=1024, kv_cache_memory=64 << 20)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server():
    args = [a for key, value in CONFIG.items() for a in ("--set", f"{key}={value}")]
    proc = ServerProcess([*args, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    with proc.serving() as ready:
        yield ready


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, messages=ASK, max_tokens: int = 48, **extra):
    return client.chat.completions.create(model="smollm2", messages=messages, max_completion_tokens=max_tokens,
                                          temperature=0, **extra)


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["France", "Spain", "Italy"]
    population_millions: int = Field(ge=0, le=50)


def test_parse_with_a_pydantic_model_gives_a_validated_object(client):
    completion = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_completion_tokens=60, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)


def test_json_object_gives_json(client):
    completion = _chat(client, [{"role": "user", "content": "Give me a JSON object with a key 'a'."}], 60,
                       response_format={"type": "json_object"})
    text = completion.choices[0].message.content
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def test_guided_choice_and_regex_on_chat_and_completions(client):
    chat = _chat(client, [{"role": "user", "content": "Is the sky blue?"}], 5,
                 extra_body={"guided_choice": ["yes", "no"]})
    assert chat.choices[0].message.content in ("yes", "no") and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model="smollm2", prompt="The year the Eiffel tower was built:",
                                           max_tokens=8, temperature=0, extra_body={"guided_regex": r"1[0-9]{3}"})
    assert re.fullmatch(r"1[0-9]{3}", completion.choices[0].text)
    vllm = client.completions.create(model="smollm2", prompt="Pick a colour:", max_tokens=5, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert vllm.choices[0].text in ("red", "green")
    for backend in ("guidance", "xgrammar"):  # vLLM 0.x's per-request backend, honoured here
        picked = _chat(client, [{"role": "user", "content": "Is the sky blue?"}], 5,
                       extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": backend})
        assert picked.choices[0].message.content in ("yes", "no")
    # A backend that is not installed: a 400 naming it (and, for this project's, the package to install).
    with pytest.raises(openai.BadRequestError, match=r"unknown grammar backend 'outlines'; installed: guidance"):
        _chat(client, [{"role": "user", "content": "Is the sky blue?"}], 5,
              extra_body={"guided_choice": ["yes", "no"], "guided_decoding_backend": "outlines"})


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_required_and_named_tool_choice_give_calls_that_validate(client):
    required = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for name, arguments in _calls(choice.message):
        jsonschema.validate(arguments, PARAMETERS[name])
    assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    named = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  max_tokens=60)
    assert named.choices[0].finish_reason == "tool_calls"
    ((name, arguments), *_) = _calls(named.choices[0].message)
    assert name == "get_time"
    jsonschema.validate(arguments, PARAMETERS["get_time"])


def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(client):
    kwargs = dict(model="smollm2", messages=ASK, max_completion_tokens=60, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs)
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == _calls(whole.choices[0].message)
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_parses_the_models_own_hermes_call_streamed_and_not(client):
    # The call is what a Hermes model writes; the regex makes SmolLM2 write it, so the auto path —
    # parser, content, finish reason, streaming — is exercised deterministically.
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    kwargs = dict(tools=TOOLS, extra_body={"guided_regex": "Checking\\. " + re.escape(call)}, max_tokens=40)
    message = _chat(client, **kwargs).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content == "Checking."
    assert _calls(message.message) == [("get_time", {"zone": "CET"})]
    chunks = list(client.chat.completions.create(model="smollm2", messages=ASK, max_completion_tokens=40,
                                                 temperature=0, stream=True, **{k: v for k, v in kwargs.items()
                                                                                if k != "max_tokens"}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.strip() == "Checking." and "<tool" not in content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_result_in_history_renders_and_the_request_succeeds(client):
    first = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    assistant = first.choices[0].message
    history = [*ASK, assistant.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": "Sunny, 21 degrees."}]
    answer = _chat(client, history, 12, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls
    again = _chat(client, [*ASK, assistant.model_dump(), history[-1]], 8)  # the full dump, no tools now
    assert again.choices[0].message.content is not None


def test_responses_text_format_gives_a_validated_object(client):
    response = client.responses.parse(model="smollm2", input="Describe Paris as JSON.", text_format=City,
                                      max_output_tokens=60, temperature=0)
    assert response.status == "completed" and isinstance(response.output_parsed, City)
    assert response.text.format.type == "json_schema"


RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
"""TOOLS in the Responses API's shape (the function's fields at the top level)."""


def _response_calls(response):
    return [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]


def test_responses_tools_give_function_call_items_streamed_and_not(client):
    kwargs = dict(model="smollm2", input=ASK[0]["content"], max_output_tokens=60, temperature=0, tools=RESPONSE_TOOLS,
                  tool_choice={"type": "function", "name": "get_weather"})
    response = client.responses.create(**kwargs)
    assert response.status == "completed" and [item.type for item in response.output] == ["function_call"]
    ((name, arguments),) = _response_calls(response)
    assert name == "get_weather"
    jsonschema.validate(arguments, PARAMETERS["get_weather"])
    call = response.output[0]
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    assert json.loads(events[3].delta) == arguments == json.loads(events[4].arguments)
    assert _response_calls(events[-1].response) == _response_calls(response)
    required = client.responses.create(**{**kwargs, "tool_choice": "required", "parallel_tool_calls": False})
    ((name, arguments),) = _response_calls(required)
    jsonschema.validate(arguments, PARAMETERS[name])


def test_responses_auto_reads_the_models_own_call_after_its_text(client):
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    kwargs = dict(model="smollm2", input=ASK, max_output_tokens=40, temperature=0, tools=RESPONSE_TOOLS,
                  extra_body={"structured_outputs": {"regex": "Checking\\. " + re.escape(call)}})
    response = client.responses.create(**kwargs)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text.strip() == "Checking." and _response_calls(response) == [("get_time", {"zone": "CET"})]
    events = list(client.responses.create(stream=True, **kwargs))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.strip() == "Checking." and "<tool" not in deltas
    assert _response_calls(events[-1].response) == [("get_time", {"zone": "CET"})]
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]


def test_responses_take_calls_and_their_results_back_as_input(client):
    first = client.responses.create(model="smollm2", input=ASK, max_output_tokens=60, temperature=0,
                                    tools=RESPONSE_TOOLS, tool_choice="required", parallel_tool_calls=False)
    call = next(item for item in first.output if item.type == "function_call")
    history = [*ASK, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}]
    answer = client.responses.create(model="smollm2", input=history, max_output_tokens=12, temperature=0,
                                     tools=RESPONSE_TOOLS, tool_choice="none")
    assert answer.output_text and not _response_calls(answer)
    # The same conversation on chat completions renders the same prompt: equal greedy answers.
    chat = _chat(client, [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees."}], 12, tools=TOOLS,
        tool_choice="none")
    assert answer.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "paramters": {}}]}, "tools[0].paramters"),
    ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "function", "name": "launch_rocket"}}, "tool_choice.name"),
    ({"tools": RESPONSE_TOOLS, "tool_choice": {"type": "mcp", "server_label": "x"}}, "tool_choice"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "get_time"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
])
def test_responses_bad_tools_are_400s_naming_the_field(client, fields, param):
    body = {"model": "smollm2", "input": "Hi", "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.param == param, info.value.body
    if param == "tool_choice.name":
        assert "launch_rocket" in info.value.message


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}},
     "tool_choice.function.name"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "tags": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, max_tokens=4, **extra)
    assert info.value.param == param, info.value.body
    if param == "tool_choice.function.name":
        assert "launch_rocket" in info.value.message
    if "uniqueItems" in json.dumps(extra):  # a keyword no backend enforces: refused, never ignored
        assert info.value.code == "unsupported" and "uniqueItems" in info.value.message


# -- LangChain ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                                       max_tokens=60, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    result = chat_model.with_structured_output(City, method=method).invoke("Describe Paris.")
    assert isinstance(result, City)


def test_langchain_tools_with_nested_models(server, chat_model):
    """Issue 52 item 6: a JSON schema's ``$defs`` and ``$ref``s go to the server as the tool's parameters
    (LangChain inlines a pydantic class's, but passes a schema dict as it is)."""
    roomy = type(chat_model)(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                             max_tokens=120, max_retries=0)
    schema = Trip.model_json_schema()
    assert "$defs" in schema
    result = roomy.with_structured_output(schema, method="function_calling").invoke("Plan a trip from Paris to Rome.")
    assert isinstance(Trip.model_validate(result), Trip)


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_bind_tools(server, chat_model, responses_api):
    if responses_api:
        chat_model = type(chat_model)(base_url=server.url + "/v1", api_key="unused", model="smollm2", temperature=0,
                                      max_tokens=60, max_retries=0, use_responses_api=True)
    message = chat_model.bind_tools(TOOLS, tool_choice="any").invoke("What is the weather like in Paris?")
    assert message.tool_calls
    for call in message.tool_calls:
        jsonschema.validate(call["args"], PARAMETERS[call["name"]])


# -- client libraries that expect exactly one call (issue 53 items 1-2, issue 52 item 6) ------------


SAMPLED_SEED = 1
"""A seed with which SmolLM2, sampling at temperature 0.7, wrote two calls where one was asked for
(before named functions and parallel_tool_calls=false were constrained to one call)."""


class Trip(BaseModel):
    """A nested model: its JSON schema carries ``$defs`` and ``$ref``s."""

    origin: City
    destination: City


def test_a_named_function_gives_one_complete_call_as_instructor_expects(client):
    # instructor's default mode (TOOLS): a named tool_choice, then IncompleteOutputException on
    # finish_reason "length", and exactly one call validated into the model.
    for model in (City, Trip):
        completion = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Describe Paris and Rome as JSON."}],
            tools=[openai.pydantic_function_tool(model)],
            tool_choice={"type": "function", "function": {"name": model.__name__}}, max_completion_tokens=120,
            temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message
        model.model_validate_json(choice.message.tool_calls[0].function.arguments)


def test_openai_pydantic_function_tool_with_nested_models_parses(client):
    completion = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "Plan a trip from Paris to Rome."}],
        tools=[openai.pydantic_function_tool(Trip)], tool_choice="required", parallel_tool_calls=False,
        max_completion_tokens=120, temperature=0)
    (call,) = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Trip)


def test_openai_agents_runs_a_named_tool_once(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """Get the current weather in a city."""
        calls.append((city, unit))
        return "Sunny, 21 degrees."

    model = agents.OpenAIChatCompletionsModel(model="smollm2", openai_client=server.async_client())
    # Sampled, as clients do by default (seeded: with the array grammar, this seed wrote two calls).
    settings = agents.ModelSettings(tool_choice="get_weather", temperature=0.7, max_tokens=60,
                                    extra_body={"seed": SAMPLED_SEED})
    agent = agents.Agent(name="weather", instructions="Answer questions about the weather.", model=model,
                         tools=[get_weather], tool_use_behavior="stop_on_first_tool", model_settings=settings)
    result = agents.Runner.run_sync(agent, ASK[0]["content"], max_turns=2)
    assert len(calls) == 1 and result.final_output == "Sunny, 21 degrees."


def test_litellm_tool_round_trip_with_its_own_message_in_the_history(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of litellm's price list
    litellm = pytest.importorskip("litellm")
    kwargs = dict(model="openai/smollm2", api_base=server.url + "/v1", api_key="unused", temperature=0.7,
                  seed=SAMPLED_SEED, num_retries=0, tools=TOOLS)
    first = litellm.completion(messages=ASK, max_tokens=60,
                               tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kwargs)
    message = first.choices[0].message
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), PARAMETERS["get_weather"])
    # litellm's ordinary round trip: its own message object (provider_specific_fields and all) goes back.
    history = [*ASK, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "Sunny."}]
    second = litellm.completion(messages=history, max_tokens=12, tool_choice="none", **kwargs)
    assert second.choices[0].message.content
