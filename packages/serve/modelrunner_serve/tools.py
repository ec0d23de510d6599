"""Tools on chat completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` → a :class:`ToolPlan`.

- ``none``: the model answers in text (a tool-aware template still sees the tools, as in vLLM).
- ``required`` and a named function (``{"type": "function", "function": {"name": ...}}``): the
  grammar backend constrains the output to calls whose ``parameters`` validate against the
  function's schema (vLLM's way), so any model returns calls that parse. A named function, and
  ``required`` with ``parallel_tool_calls: false``, give exactly one call: the output is one object
  ``{"name", "parameters"}``; ``required`` otherwise gives a JSON array of one or more. A function's
  ``$defs`` (nested pydantic models) move to the root of that schema, their ``$ref``s rewritten; the
  calls are spaced as ``json.dumps`` spaces JSON (no free whitespace to wander into). No
  tool-call parser is needed; an answer cut short (``max_tokens``) is no call and no content, never
  the server's own JSON.
- ``auto`` (the default when tools are given): the model writes calls in its own format and the
  server's tool-call parser (``--enable-auto-tool-choice --tool-call-parser NAME``) finds them; a call
  cut short by ``max_tokens`` is dropped with its markup, the text before it kept as content.

A template with tool support gets ``tools=`` (and the history's ``tool_calls``); for one without it
(e.g. SmolLM2's), the functions and the format to call them in are described in a system message,
and earlier calls are written into the assistant's text in that format.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from modelrunner.sampling.structured import StructuredOutputsParams
from modelrunner.structured_output.backend_schema import escape_pointer, map_subschemas, subschemas
from modelrunner.tool_parser import ParsedOutput, ToolCall, ToolParser
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

    @property
    def single(self) -> bool:
        """A forced answer is exactly one call (a named function, or ``parallel_tool_calls`` false)."""
        return self.forced and (self.choice == "named" or not self.parallel)

    def schema(self) -> dict[str, Any]:
        """The JSON schema a forced answer follows: one ``{"name": <one of names>, "parameters": <its
        parameters>}`` (:attr:`single`), else an array of one or more of them; the functions'
        ``$defs`` gathered at its root (see :func:`hoisted_parameters`)."""
        definitions: dict[str, Any] = {}
        members = [{"type": "object",
                    "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                   "parameters": hoisted_parameters(f.get("parameters"), f["name"], definitions)},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for f in self.functions if f["name"] in self.names]
        call = members[0] if len(members) == 1 else {"anyOf": members}
        schema: dict[str, Any] = dict(call) if self.single else {"type": "array", "minItems": 1, "items": call}
        if definitions:
            schema["$defs"] = definitions
        return schema

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The constraint of a forced answer (None for ``none`` and ``auto``): its JSON spaced as
        ``json.dumps`` spaces it, so no model can wander into endless whitespace inside a call."""
        return StructuredOutputsParams(json=self.schema(), disable_any_whitespace=True) if self.forced else None

    def parse(self, text: str, finish_reason: str | None = None) -> ParsedOutput:
        """A finished answer as content and calls: a forced one read as its JSON, an ``auto`` one by
        the parser; text that does not read as calls stays content, except the server's own syntax
        (a forced answer that is not a whole call has no content) and, when the answer was cut short
        (``finish_reason="length"``), the markup of a call it did not finish (dropped with
        everything after it: the content is the text before it)."""
        if self.forced:
            parsed = forced_calls(text)
            if not parsed.tool_calls:  # cut short: the server's own JSON is not the model's content
                return ParsedOutput(None)
            return ParsedOutput(None, parsed.tool_calls[:1]) if self.single else parsed
        if self.choice != "auto" or self.parser is None:
            return ParsedOutput(text)
        parsed = self.parser.parse(text)
        if not self.parallel and len(parsed.tool_calls) > 1:
            parsed = ParsedOutput(parsed.content, parsed.tool_calls[:1])
        if finish_reason == "length" and parsed.content:
            kept = parsed.content[:self.parser.streamable(parsed.content)].strip()
            parsed = ParsedOutput(kept or None, parsed.tool_calls)
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
        if self.single:
            which = f"the function {self.names[0]}" if self.choice == "named" else "one of the functions"
            return (f"You have access to these functions (JSON schemas of their parameters):\n{listed}\n\n"
                    f"Answer by calling {which} once: a JSON object with the function's name and its parameters, "
                    f"like this:\n{written_calls([example])[1:-1]}")
        if self.forced:
            return (f"You have access to these functions (JSON schemas of their parameters):\n{listed}\n\n"
                    f"Answer by calling one or more of the functions: a JSON array of calls, each with the "
                    f"function's name and its parameters, like this:\n{written_calls([example])}")
        return (f"You have access to these functions (JSON schemas of their parameters):\n{listed}\n\n"
                f"To call a function, answer with the call written exactly like this example:\n"
                f"{self.format_calls([example])}\nOtherwise, answer normally.")


def hoisted_parameters(parameters: Any, owner: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema made to work where the forced-call schema nests it (under
    ``properties.parameters``): its ``$defs`` / ``definitions`` move into ``definitions`` (the root's
    ``$defs``) as ``"<owner>.<name>"``, and its ``$ref``s are rewritten to match; a ``$ref`` to its own
    root (``#`` or ``#/properties/...``, a recursive model) points at a copy of it kept there as
    ``"<owner>"``. ``{"type": "object", "properties": {}}`` for None. What pydantic's
    ``model_json_schema`` writes for nested models (LangChain's and openai's ``pydantic_function_tool``)."""
    if not parameters:
        return {"type": "object", "properties": {}}
    local = {(key, name): sub for key in ("$defs", "definitions") if isinstance(parameters.get(key), dict)
             for name, sub in parameters[key].items()}
    if not local and not any(ref.startswith("#") for ref in _refs_in(parameters)):
        return parameters
    moved = {(key, name): f"{owner}.{name}" for key, name in local}
    to_root = [False]

    def rewrite(ref: str) -> str:
        for (key, name), new in moved.items():
            old = f"#/{key}/{escape_pointer(str(name))}"
            if ref == old or ref.startswith(old + "/"):
                return f"#/$defs/{escape_pointer(new)}{ref[len(old):]}"
        if ref == "#" or ref.startswith("#/"):
            to_root[0] = True
            return f"#/$defs/{escape_pointer(owner)}{ref[1:]}"
        return ref  # not local: refused by the schema check, naming it

    body = _with_refs(parameters, rewrite)
    for key in ("$defs", "definitions"):
        body.pop(key, None)
    for (key, name), new in moved.items():
        definitions[new] = _with_refs(local[(key, name)], rewrite)
    if to_root[0]:
        definitions[owner] = body
        return {"$ref": f"#/$defs/{escape_pointer(owner)}"}
    return body


def _refs_in(node: Any) -> list[str]:
    stack, found = [(node, "#")], []
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict) and isinstance(item.get("$ref"), str):
            found.append(item["$ref"])
        stack.extend(subschemas(item, where))
    return found


def _with_refs(node: Any, rewrite: Callable[[str], str]) -> Any:
    """A copy of schema ``node`` with every ``$ref`` in it passed through ``rewrite``."""
    out = map_subschemas(node, lambda sub: _with_refs(sub, rewrite))
    if isinstance(out, dict) and isinstance(out.get("$ref"), str):
        out["$ref"] = rewrite(out["$ref"])
    return out


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
    """A forced answer (``{"name", "parameters"}`` or an array of them) as calls; text that is not one
    (generation stopped early) stays content."""
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
    from modelrunner.plugins import get_plugins

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


__all__ = ["AUTO_FLAGS", "TOOL_CHOICES", "ToolPlan", "example_arguments", "forced_calls", "hoisted_parameters",
           "template_supports_tools", "tool_calls_of", "tool_parser", "tool_plan", "written_calls"]
