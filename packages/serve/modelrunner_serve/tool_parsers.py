"""The server's tool-call parsers (``--tool-call-parser``): ``hermes``, ``llama3_json`` and ``mistral``,
vLLM's names for the formats of the model families that write them, declared through this
distribution's ``tool-parsers`` entry point (the kernel holds their base class, ``ToolParser``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from modelrunner.api import ParsedOutput, ToolCall, ToolParser, hookimpl, json_values


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


def _calls(values: list[Any] | None, arguments_keys: tuple[str, ...]) -> list[ToolCall] | None:
    """Calls from JSON values — objects, or arrays of objects, with ``name`` and one of
    ``arguments_keys`` — or None where any value is not one."""
    if not values:
        return None
    calls = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict):
                return None
            arguments = next((item[k] for k in arguments_keys if k in item), {})
            call = ToolCall.of(item.get("name"), arguments)
            if call is None:
                return None
            calls.append(call)
    return calls or None


class HermesToolParser(ToolParser):
    """Hermes and Qwen (2.5, 3): each call a JSON object ``{"name", "arguments"}`` inside
    ``<tool_call>…</tool_call>``, text around them as content."""

    name = "hermes"
    start_markers = ("<tool_call>",)
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        """The ``<tool_call>`` blocks (the last may lack its closing tag: generation stopped there)."""
        calls: list[ToolCall] = []
        content: list[str] = []
        at = 0
        while (start := text.find(self.OPEN, at)) >= 0:
            end = text.find(self.CLOSE, start)
            inner = text[start + len(self.OPEN): end if end >= 0 else len(text)]
            found = _calls(json_values(inner), ("arguments", "parameters"))
            if found is None:  # not a call: the block stays as written
                content.append(text[at: end + len(self.CLOSE) if end >= 0 else len(text)])
            else:
                content.append(text[at:start])
                calls.extend(found)
            at = end + len(self.CLOSE) if end >= 0 else len(text)
        content.append(text[at:])
        return ParsedOutput(_content(*content), tuple(calls))

    def format(self, calls: Sequence[ToolCall]) -> str:
        """One ``<tool_call>`` block per call."""
        return "\n".join(f"{self.OPEN}\n{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments)})}\n"
                         f"{self.CLOSE}" for c in calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1-3.3 with JSON tool calling: the whole answer is ``{"name", "parameters"}`` (several
    separated by ``;``), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    start_markers = ("<|python_tag|>", "{")
    markers_at_start = True
    content_before_calls = False
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        """Calls only where the answer starts with one; otherwise all of it is content."""
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return ParsedOutput(_content(text))
        calls = _calls(json_values(body), ("parameters", "arguments"))
        return ParsedOutput(_content(text)) if calls is None else ParsedOutput(None, tuple(calls))

    def format(self, calls: Sequence[ToolCall]) -> str:
        """The calls' JSON objects joined by ``; ``."""
        return "; ".join(json.dumps({"name": c.name, "parameters": json.loads(c.arguments)}) for c in calls)


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v0.3 tokenizers), or
    ``[TOOL_CALLS]name[ARGS]{…}`` per call (v11 and later); text before it as content."""

    name = "mistral"
    start_markers = ("[TOOL_CALLS]",)
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> ParsedOutput:
        """Everything after the first ``[TOOL_CALLS]`` as calls, where it reads as calls."""
        at = text.find(self.MARK)
        if at < 0:
            return ParsedOutput(_content(text))
        rest = text[at:]
        calls: list[ToolCall] | None = []
        if self.ARGS in rest:
            for part in rest.split(self.MARK)[1:]:
                name, _, arguments = part.partition(self.ARGS)
                values = json_values(arguments)
                call = ToolCall.of(name.strip(), values[0]) if values and len(values) == 1 else None
                if call is None:
                    calls = None
                    break
                calls.append(call)
        else:
            calls = _calls(json_values(rest[len(self.MARK):]), ("arguments", "parameters"))
        return ParsedOutput(_content(text)) if not calls else ParsedOutput(_content(text[:at]), tuple(calls))

    def format(self, calls: Sequence[ToolCall]) -> str:
        """``[TOOL_CALLS]`` and the calls as one JSON array."""
        return self.MARK + json.dumps([{"name": c.name, "arguments": json.loads(c.arguments)} for c in calls])


TOOL_PARSERS = (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
"""The tool-call parsers this distribution declares."""


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in tool-call parsers."""
    registry.tool_parsers(*TOOL_PARSERS)


__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser"]
