"""The kernel's tool-call parsers on the texts their model families write, and through the real
``modelrunner check``."""

from __future__ import annotations

import json

import pytest
from modelrunner.plugins import get_plugins
from modelrunner.tool_parser import ToolCall
from plugin_dists import run_cli


def parser(name: str):
    return get_plugins().tool_parser_class(name)()


@pytest.mark.parametrize(("name", "text", "content", "calls"), [
    ("hermes", 'I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "I will check.", [("get_weather", {"city": "Oslo"})]),
    # Generation stopped at the closing tag (a stop string): the last block has none.
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}',
     None, [("a", {}), ("b", {"x": 1})]),
    ("hermes", "<tool_call>not json</tool_call> and more", "<tool_call>not json</tool_call> and more", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
     [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}}', None,
     [("a", {}), ("b", {"q": "x"})]),
    ("llama3_json", 'The answer is {"name": "a"}.', 'The answer is {"name": "a"}.', []),
    ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, but not a call
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "Sure.",
     [("get_weather", {"city": "Oslo"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]ping[ARGS]{}', None,
     [("get_weather", {"city": "Oslo"}), ("ping", {})]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
])
def test_parsers_read_their_familys_text(name, text, content, calls):
    parsed = parser(name).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert all(c.as_openai()["type"] == "function" and c.id.startswith("call_") for c in parsed.tool_calls)


def test_streaming_holds_back_what_may_begin_a_call():
    hermes = parser("hermes")
    assert hermes.streamable("Let me <tool") == len("Let me ")  # could be the start of a call
    assert hermes.streamable("Let me <b>look</b>") == len("Let me <b>look</b>")
    assert hermes.streamable('Hi <tool_call>{"na') == len("Hi ")
    llama = parser("llama3_json")
    assert llama.streamable('  {"na') == 0 and llama.streamable("Hello {x}") == len("Hello {x}")


def test_arguments_must_be_an_object():
    assert ToolCall.of("f", "[1, 2]") is None and ToolCall.of("", {}) is None and ToolCall.of("f", None) is not None


def test_check_runs_the_suite_on_the_kernels_parsers():
    run = run_cli("check", "tool-parsers")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tool-parsers: 17 passed, 0 failed, 1 skipped" in run.stdout
