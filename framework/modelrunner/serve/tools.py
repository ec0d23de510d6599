"""Tools on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` → a :class:`ToolPlan`.

- ``none``: the model answers in text (a tool-aware template still sees the tools, as in vLLM).
- ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``): the
  grammar backend constrains the output to a JSON array of calls, ``[{"name", "parameters"}]``, whose
  ``parameters`` validate against the function's schema (vLLM's way), so any model returns calls
  that parse. No tool-call parser is needed.
- ``auto`` (the default when tools are given): the model writes calls in its own format and the
  server's tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds them.

A template with tool support gets ``tools=`` (and the history's ``tool_calls``); for one without it
(e.g. SmolLM2's), the functions and the format to call them in are described in a system message,
and earlier calls are written into the assistant's text in that format.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import attrs

from ..sampling.structured import StructuredOutputsParams
from ..tool_parser import ParsedOutput, ToolCall, ToolParser
from .errors import bad_request

TOOL_CHOICES = ("none", "auto", "required")
"""``tool_choice`` strings (a named function is an object)."""
AUTO_FLAGS = "--enable-auto-tool-choice --tool-call-parser NAME"
"""What a server needs for ``tool_choice="auto"`` (vLLM's flags)."""
_PROBE = "modelrunner_probe_function"


@attrs.frozen
class ToolPlan:
    """How one chat request uses its tools."""

    functions: tuple[dict[str, Any], ...]
    """``{"name", "description", "parameters"}`` per tool, as given."""
    choice: str
    """``none``, ``auto``, ``required`` or ``named``."""
    names: tuple[str, ...]
    """The functions the model may call (``named``: that one)."""
    parallel: bool
    """More than one call per answer (``parallel_tool_calls``, default true)."""
    parser: ToolParser | None
    """The server's tool-call parser (used by ``auto``, and to write earlier calls for templates
    without tool support)."""

    @property
    def forced(self) -> bool:
        """The grammar makes the answer calls (``required`` or a named function)."""
        return self.choice in ("required", "named")

    @property
    def calls_tools(self) -> bool:
        """The answer may hold calls (``auto``, ``required``, named)."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]]:
        """``tools=`` for the chat template (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def schema(self) -> dict[str, Any]:
        """The JSON schema a forced answer follows: an array of 1 (or more, with parallel calls) of
        ``{"name": <one of names>, "parameters": <its parameters>}``."""
        members = [{"type": "object",
                    "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                   "parameters": f.get("parameters") or {"type": "object", "properties": {}}},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for f in self.functions if f["name"] in self.names]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": members[0] if len(members) == 1 else {"anyOf": members}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of a forced answer (None for ``none`` and ``auto``)."""
        return StructuredOutputsParams(json=self.schema()) if self.forced else None

    def parse(self, text: str) -> ParsedOutput:
        """A finished answer as content and calls: a forced one read as the JSON array, an ``auto``
        one by the parser; text that does not read as calls stays content."""
        if self.forced:
            return forced_calls(text)
        if self.choice != "auto" or self.parser is None:
            return ParsedOutput(text)
        parsed = self.parser.parse(text)
        if not self.parallel and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(parsed.content, parsed.tool_calls[:1])
        return parsed

    def streamable(self, text: str) -> int:
        """How much of an answer so far may be streamed as content (none of a forced one)."""
        if self.forced:
            return 0
        if self.choice != "auto" or self.parser is None:
            return len(text)
        return self.parser.streamable(text)

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """Earlier calls as the model would write them (templates without tool support): in the
        parser's format for ``auto``, else as the JSON array a forced answer is."""
        if self.parser is not None and not self.forced:
            return self.parser.format(calls)
        return written_calls(calls)

    def prompt(self) -> str:
        """The system message describing the tools, for templates without tool support."""
        listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions if f["name"] in self.names)
        example_function = next(f for f in self.functions if f["name"] in self.names)
        example = ToolCall(example_function["name"], json.dumps(example_arguments(example_function.get("parameters"))))
        if self.forced:
            which = f"the function {self.names[0]}" if self.choice == "named" else "one or more of the functions"
            return (f"You have access to these functions (JSON schemas of their parameters):\n{listed}\n\n"
                    f"Answer by calling {which}: a JSON array of calls, each with the function's name and its "
                    f"parameters, like this:\n{written_calls([example])}")
        return (f"You have access to these functions (JSON schemas of their parameters):\n{listed}\n\n"
                f"To call a function, answer with the call written exactly like this example:\n"
                f"{self.format_calls([example])}\nOtherwise, answer normally.")


def example_arguments(schema: Any) -> dict[str, Any]:
    """Placeholder arguments for a parameters schema (one value per property, by its type)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return {}
    placeholders = {"string": "...", "integer": 0, "number": 0, "boolean": True, "array": [], "object": {}}
    values = {}
    for name, spec in properties.items():
        spec = spec if isinstance(spec, dict) else {}
        if isinstance(spec.get("enum"), list) and spec["enum"]:
            values[name] = spec["enum"][0]
        else:
            kind = spec.get("type")
            values[name] = placeholders.get(kind[0] if isinstance(kind, list) and kind else kind, "...")
    return values


def written_calls(calls: Sequence[ToolCall]) -> str:
    """Calls as the JSON array a forced answer is: ``[{"name", "parameters"}]``."""
    return json.dumps([{"name": c.name, "parameters": json.loads(c.arguments)} for c in calls], ensure_ascii=False)


def forced_calls(text: str) -> ParsedOutput:
    """A forced answer (``[{"name", "parameters"}, ...]``) as calls; text that is not one (generation
    stopped early) stays content."""
    try:
        values = json.loads(text)
    except ValueError:
        return ParsedOutput(text.strip() or None)
    items = values if isinstance(values, list) else [values]
    calls = [ToolCall.of(v.get("name"), v.get("parameters", v.get("arguments"))) if isinstance(v, dict) else None
             for v in items]
    if not calls or not all(calls):
        return ParsedOutput(text.strip() or None)
    return ParsedOutput(None, tuple(c for c in calls if c is not None))


@functools.lru_cache(maxsize=None)
def tool_parser(name: str) -> ToolParser:
    """The server's instance of the tool-call parser registered as ``name``.

    :raises UnknownNameError: no parser has that name (the message lists those that exist).
    """
    from ..plugins import get_plugins

    return get_plugins().tool_parser_class(name)()


def tool_plan(body: Any, settings: Any) -> ToolPlan | None:
    """The plan of a chat request (None: it gives no tools, and ``tool_choice`` none or absent).

    :raises APIError: 400 naming the field: a malformed tool, ``tool_choice`` without tools or naming a
        function not in ``tools``, or ``auto`` on a server started without :data:`AUTO_FLAGS`.
    """
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise bad_request(f"tool_choice {choice!r} needs tools; give tools, or leave tool_choice out",
                              param="tool_choice")
        return None
    functions = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = tuple(f["name"] for f in functions)
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise bad_request(f"tools: the function name {duplicate!r} is given twice", param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                              f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r:.200}",
                              param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools (given: "
                              f"{', '.join(names)})", param="tool_choice.function.name")
        kind, allowed = "named", (name,)
    elif choice in TOOL_CHOICES:
        kind, allowed = choice, names
    else:
        raise bad_request(f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r:.200}",
                          param="tool_choice")
    parser = tool_parser(settings.tool_call_parser) if settings.tool_call_parser else None
    if kind == "auto" and not (settings.enable_auto_tool_choice and parser is not None):
        raise bad_request(f'"auto" tool choice requires the server to be started with {AUTO_FLAGS} (e.g. '
                          f'--tool-call-parser hermes); or ask for tool_choice "required" or a named function, '
                          f'which need no parser', param="tool_choice", code="unsupported")
    return ToolPlan(functions, kind, allowed, body.parallel_tool_calls is not False, parser)


def _function(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name', 'description', "
                          f"'parameters'}}}}; got {tool!r:.200}", param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function.name must be a non-empty string", param=f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                          param=f"{where}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description must be a string", param=f"{where}.function.description")
    return {k: v for k, v in (("name", name), ("description", description), ("parameters", parameters))
            if v is not None}


def template_supports_tools(llm: Any, chat_template: str | None) -> bool:
    """True when the chat template renders ``tools=`` (its prompt names a probe function)."""
    tokenizer = llm.get_tokenizer()
    key = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    cache = _support_cache.setdefault(id(tokenizer), {})
    if key not in cache:
        tools = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            prompt = llm.chat_prompt([{"role": "user", "content": "hi"}], chat_template=chat_template,
                                     chat_template_kwargs={"tools": tools})["prompt"]
        except ValueError:
            prompt = ""
        cache[key] = _PROBE in prompt
    return cache[key]


_support_cache: dict[int, dict[str | None, bool]] = {}


def tool_calls_of(message: dict[str, Any], where: str) -> list[ToolCall]:
    """An assistant message's ``tool_calls`` (OpenAI's shape) as calls.

    :raises APIError: 400 naming the call at fault.
    """
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        parsed = ToolCall.of(function.get("name"), function.get("arguments")) if isinstance(function, dict) else None
        if parsed is None:
            raise bad_request(f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments': "
                              f"a JSON object's text}}}}; got {call!r:.200}", param=at)
        calls.append(ToolCall(parsed.name, parsed.arguments, str(call.get("id") or parsed.id)))
    return calls


__all__ = ["AUTO_FLAGS", "TOOL_CHOICES", "ToolPlan", "example_arguments", "forced_calls", "template_supports_tools",
           "tool_calls_of", "tool_parser", "tool_plan", "written_calls"]
