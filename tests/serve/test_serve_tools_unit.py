"""The server's tool calling and structured-output request handling, in process and without a
model: tool plans (choices, the forced-call schema, errors), parsing answers into tool calls,
streaming them as OpenAI does, and rendering tools and earlier calls through chat templates with
and without tool support (issue 33, item 3)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from modelrunner_serve.chat import ChatOptions, parse_messages, render
from modelrunner_serve.chat_completions import ChatJob, ToolStream, chat_body
from modelrunner_serve.deltas import CompletionDelta
from modelrunner_serve.errors import APIError
from modelrunner_serve.structured import structured_outputs_of
from modelrunner_serve.tools import tool_plan

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES = SimpleNamespace(enable_auto_tool_choice=True, tool_call_parser="hermes")
NO_PARSER = SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None)


def _body(**fields):
    base = dict(tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None, structured_outputs=None,
                guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None,
                guided_whitespace_pattern=None, guided_decoding_backend=None)
    return SimpleNamespace(**{**base, **fields})


def _refused(call, param: str) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    assert info.value.status == 400 and info.value.param == param, (info.value.param, str(info.value))
    return info.value


# -- tool plans -----------------------------------------------------------------------------------


def test_forced_schema_accepts_calls_of_the_allowed_functions_only():
    plan = tool_plan(_body(tools=[WEATHER, TIME], tool_choice="required"), NO_PARSER)
    schema = plan.schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}], schema)
    jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)  # parallel calls by default
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Paris"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tool_plan(_body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                      NO_PARSER)
    assert named.choice == "named" and named.names == ("get_time",)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "parameters": {"city": "x", "unit": "c"}}, named.schema())
    assert named.structured_outputs().json == named.schema()


@pytest.mark.parametrize("choice, parallel", [({"type": "function", "function": {"name": "get_time"}}, None),
                                              ({"type": "function", "function": {"name": "get_time"}}, True),
                                              ("required", False)])
def test_a_named_function_or_required_without_parallel_calls_is_one_call_never_an_array(choice, parallel):
    """Issue 53 item 1: instructor, openai-agents and litellm expect exactly one call here."""
    plan = tool_plan(_body(tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=parallel), NO_PARSER)
    assert plan.single
    schema = plan.schema()
    jsonschema.validate({"name": "get_time", "parameters": {}}, schema)
    for several in ([{"name": "get_time", "parameters": {}}], [{"name": "get_time", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(several, schema)
    assert "once: a JSON object" in plan.prompt()
    parsed = plan.parse('{"name": "get_time", "parameters": {}}')
    assert parsed.content is None and [c.name for c in parsed.tool_calls] == ["get_time"]


def test_tools_with_nested_pydantic_models_get_their_defs_at_the_schemas_root():
    """Issue 52 item 6: ``$defs`` + ``$ref`` (LangChain's and openai's pydantic_function_tool) work as tools."""
    from typing import Optional

    from pydantic import BaseModel

    from modelrunner.structured_output.backend_schema import schema_problem

    class Address(BaseModel):
        street: str
        city: str

    class Person(BaseModel):
        name: str
        home: Address
        friend: Optional["Person"] = None

    other = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Address"}}, "required": ["at"],
             "$defs": {"Address": {"type": "integer"}}}  # the same def name, another schema
    tools = [{"type": "function", "function": {"name": "save", "parameters": Person.model_json_schema()}},
             {"type": "function", "function": {"name": "other", "parameters": other}}]
    person = {"name": "Ann", "home": {"street": "Main", "city": "Oslo"},
              "friend": {"name": "Bo", "home": {"street": "High", "city": "Rome"}}}
    for choice in ("required", {"type": "function", "function": {"name": "save"}}):
        plan = tool_plan(_body(tools=tools, tool_choice=choice), NO_PARSER)
        schema = plan.schema()
        assert schema_problem(schema) is None and "$defs" in schema
        call = {"name": "save", "parameters": person}
        jsonschema.validate(call if plan.single else [call], schema)
        with pytest.raises(jsonschema.ValidationError):
            broken = {"name": "save", "parameters": {**person, "home": {"street": 1, "city": "Oslo"}}}
            jsonschema.validate(broken if plan.single else [broken], schema)
    both = tool_plan(_body(tools=tools, tool_choice="required"), NO_PARSER).schema()
    jsonschema.validate([{"name": "other", "parameters": {"at": 3}}], both)
    with pytest.raises(jsonschema.ValidationError):  # other's Address is its own, not save's
        jsonschema.validate([{"name": "other", "parameters": {"at": {"street": "x", "city": "y"}}}], both)


def test_tool_choice_errors_name_the_field():
    error = _refused(lambda: tool_plan(_body(tools=[WEATHER], tool_choice={"type": "function",
                                                                           "function": {"name": "nope"}}), HERMES),
                     "tool_choice.function.name")
    assert "'nope'" in str(error) and "get_weather" in str(error)
    error = _refused(lambda: tool_plan(_body(tools=[WEATHER]), NO_PARSER), "tool_choice")
    assert "--enable-auto-tool-choice --tool-call-parser" in str(error)
    _refused(lambda: tool_plan(_body(tools=[WEATHER], tool_choice="sometimes"), HERMES), "tool_choice")
    _refused(lambda: tool_plan(_body(tool_choice="required"), HERMES), "tool_choice")
    _refused(lambda: tool_plan(_body(tools=[{"type": "function", "function": {"name": ""}}]), HERMES),
             "tools[0].function.name")
    assert tool_plan(_body(tool_choice="none"), NO_PARSER) is None
    assert tool_plan(_body(tools=[WEATHER], tool_choice="none"), NO_PARSER).calls_tools is False


def test_response_format_and_guided_fields_become_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params, field = structured_outputs_of(_body(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema, "strict": True}}))
    assert (params.json, field) == (schema, "response_format")
    assert structured_outputs_of(_body(response_format={"type": "json_object"}))[0].json_object is True
    assert structured_outputs_of(_body(response_format={"type": "text"})) == (None, "")
    assert structured_outputs_of(_body(guided_choice=["a", "b"]))[0].choice == ("a", "b")
    assert structured_outputs_of(_body(structured_outputs={"regex": "[0-9]+"}))[0].regex == "[0-9]+"
    assert structured_outputs_of(_body(guided_json=schema, guided_decoding_backend="guidance"))[0].backend == "guidance"
    _refused(lambda: structured_outputs_of(_body(response_format={"type": "json_schema", "json_schema": {"name": "a"}})),
             "response_format.json_schema.schema")
    _refused(lambda: structured_outputs_of(_body(response_format={"type": "xml"})), "response_format.type")
    _refused(lambda: structured_outputs_of(_body(guided_regex="(")), "guided_regex")
    _refused(lambda: structured_outputs_of(_body(guided_regex="a", guided_choice=["a"])), "guided_choice")
    _refused(lambda: structured_outputs_of(_body(structured_outputs={"jsn": {}})), "structured_outputs")


# -- answers into tool calls ----------------------------------------------------------------------

HERMES_TEXT = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'


def _job(plan, **fields):
    values = dict(id="chatcmpl-1", created=0, model="m", n=1, top_logprobs=None, include_usage=False,
                  continuous_usage=False, return_token_ids=False, prompt_logprobs=False, tokenizer=None, tools=plan)
    return ChatJob(**{**values, **fields})


def _output(text: str, finish_reason: str = "stop"):
    completion = SimpleNamespace(index=0, text=text, token_ids=[1], logprobs=None, finish_reason=finish_reason,
                                 stop_reason=None, num_generated_tokens=1)
    return SimpleNamespace(error=None, outputs=[completion], prompt_token_ids=[1], num_cached_tokens=0)


def test_auto_answers_are_parsed_by_the_servers_parser():
    plan = tool_plan(_body(tools=[WEATHER]), HERMES)
    message = chat_body(_output(HERMES_TEXT), _job(plan))["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] == "Let me check."
    (call,) = message["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    plain = chat_body(_output("It is sunny."), _job(plan))["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "It is sunny."}


def test_forced_answers_are_read_as_json_and_a_cut_one_leaks_nothing():
    """Issue 53 item 4: a forced call cut by max_tokens is finish_reason "length", no content, no call."""
    plan = tool_plan(_body(tools=[WEATHER], tool_choice="required"), NO_PARSER)
    text = '[{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}]'
    choice = chat_body(_output(text), _job(plan))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome", "unit": "f"}
    for finish in ("length", "stop"):
        cut = chat_body(_output(text[:20], finish), _job(plan))["choices"][0]
        assert cut["finish_reason"] == finish and cut["message"]["content"] is None
        assert "tool_calls" not in cut["message"]
        streamed = _stream(plan, text[:20], finish_reason=finish)
        assert _reassemble(streamed) == ("", [], finish)


def test_an_auto_call_cut_by_max_tokens_leaves_only_the_text_before_it():
    """Issue 53 item 4: no raw ``<tool_call>`` markup in content, streamed or not."""
    plan = tool_plan(_body(tools=[WEATHER]), HERMES)
    cut = HERMES_TEXT[:HERMES_TEXT.index('"city"')]
    choice = chat_body(_output(cut, "length"), _job(plan))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Let me check."
    assert "tool_calls" not in choice["message"]
    for step in (1, 4, 1000):
        content, calls, finish = _reassemble(_stream(plan, cut, step, finish_reason="length"))
        assert (content.strip(), calls, finish) == ("Let me check.", [], "length")
    # A finished call before the cut one is kept; the answer still says it was cut.
    two = HERMES_TEXT + "\n" + cut[cut.index("<tool_call>"):]
    choice = chat_body(_output(two, "length"), _job(plan))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Let me check."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    content, calls, finish = _reassemble(_stream(plan, two, 3, finish_reason="length"))
    assert ("<tool" not in content, [c["name"] for c in calls], finish) == (True, ["get_weather"], "length")
    # Text that merely ends the answer is kept as it was.
    assert chat_body(_output("Hello <tool", "stop"), _job(plan))["choices"][0]["message"]["content"] == "Hello <tool"


def _stream(plan, text: str, step: int = 3, finish_reason: str = "stop") -> list[dict]:
    stream, chunks = ToolStream(), []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = CompletionDelta(index=0, delta_text=piece, delta_token_ids=[1], delta_logprobs=None,
                                finish_reason=finish_reason if last else None, stop_reason=None,
                                num_generated_tokens=i + 1)
        chunks.extend(stream.choices(delta, _job(plan)))
    return chunks


def _reassemble(chunks: list[dict]) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", [], None
    for choice in chunks:
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"].startswith("call_") and call["type"] == "function"
                assert call["function"]["arguments"] == ""
                calls.append({"name": call["function"]["name"], "arguments": ""})
            else:
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    return content, calls, finish


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_auto_calls_come_after_the_content_and_never_leak_into_it(step):
    plan = tool_plan(_body(tools=[WEATHER]), HERMES)
    chunks = _stream(plan, HERMES_TEXT, step)
    content, calls, finish = _reassemble(chunks)
    assert "<tool" not in content and content.strip() == "Let me check."
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert _reassemble(_stream(plan, "No call < here.", step))[:2] == ("No call < here.", [])


def test_streamed_forced_calls_send_no_content():
    plan = tool_plan(_body(tools=[WEATHER, TIME], tool_choice="required"), NO_PARSER)
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]'
    content, calls, finish = _reassemble(_stream(plan, text))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_time", {}), ("get_weather", {"city": "Oslo", "unit": "c"})]


# -- rendering ------------------------------------------------------------------------------------

TOOL_AWARE = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
              "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %} CALLS "
              "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.city }}){% endif %}"
              "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


class _TemplateOnly:
    """What ``render`` needs of an LLM: its tokenizer and ``chat_prompt``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def chat_prompt(self, *args, **kwargs):
        from modelrunner import LLM

        return LLM.chat_prompt(self, *args, **kwargs)


def test_tool_aware_templates_get_tools_and_the_calls_in_history(serve_tokenizer):
    plan = tool_plan(_body(tools=[WEATHER]), HERMES)
    prompt = render(_TemplateOnly(serve_tokenizer), serve_tokenizer, parse_messages(HISTORY, None),
                    ChatOptions(chat_template=TOOL_AWARE), tools=plan)["prompt"]
    assert prompt.startswith("TOOLS get_weather\n")
    assert "assistant:  CALLS get_weather(Paris)" in prompt and "tool: 21 C [call_1]" in prompt
    assert "You have access" not in prompt


def test_templates_without_tool_support_get_a_tool_prompt_and_calls_as_text(serve_tokenizer):
    llm = _TemplateOnly(serve_tokenizer)  # SmolLM2's ChatML template knows nothing of tools
    auto = tool_plan(_body(tools=[WEATHER]), HERMES)
    prompt = render(llm, serve_tokenizer, parse_messages(HISTORY, None), ChatOptions(), tools=auto)["prompt"]
    assert prompt.startswith("<|im_start|>system\nYou have access to these functions")
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt  # the hermes format, shown and used
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert "<|im_start|>tool\n21 C<|im_end|>" in prompt
    none = tool_plan(_body(tools=[WEATHER], tool_choice="none"), HERMES)
    quiet = render(llm, serve_tokenizer, parse_messages(HISTORY[:1], None), ChatOptions(), tools=none)["prompt"]
    assert "You have access" not in quiet
    forced = tool_plan(_body(tools=[WEATHER], tool_choice="required"), NO_PARSER)
    system = [{"role": "system", "content": "Be brief."}, HISTORY[0]]
    prompt = render(llm, serve_tokenizer, parse_messages(system, None), ChatOptions(), tools=forced)["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\nYou have access") and "a JSON array of calls" in prompt


def test_serve_settings_check_the_tool_flags():
    from modelrunner_serve.settings import ServeSettings

    assert ServeSettings(enable_auto_tool_choice=True, tool_call_parser="hermes").tool_call_parser == "hermes"
    with pytest.raises(ValueError, match="enable-auto-tool-choice needs --tool-call-parser"):
        ServeSettings(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool-call-parser: .*'nope'.*hermes, llama3_json, mistral"):
        ServeSettings(tool_call_parser="nope")
