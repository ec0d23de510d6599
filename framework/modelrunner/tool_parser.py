"""What a tool-call parser is: the plugin kind that finds the tool calls in a model's own text.

With ``tool_choice="auto"`` the model decides whether to call a tool and writes the call in its
family's own format (Hermes and Qwen: ``<tool_call>{...}</tool_call>``; Llama 3: a JSON object;
Mistral: ``[TOOL_CALLS][...]``). The server (``--enable-auto-tool-choice --tool-call-parser NAME``)
hands the finished text to the named :class:`ToolParser`, which splits it into the content the user
reads and the :class:`ToolCall` list; while streaming it asks :meth:`ToolParser.streamable` how much
of the text so far is surely content, and holds the rest back until the calls can be parsed.

A parser never raises on what a model wrote: text it cannot read as calls stays content.
Parsers are declared like any class kind: ``registry.tool_parsers(MyParser)``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class ToolCall:
    """One call of a function, as the OpenAI API returns it."""

    name: str
    """The function's name."""
    arguments: str
    """Its arguments: the text of a JSON object."""
    id: str = attrs.field(factory=_call_id)
    """A unique id the client echoes in the ``tool`` message that answers the call."""

    @classmethod
    def of(cls, name: Any, arguments: Any) -> ToolCall | None:
        """A call from parsed JSON values, or None where they are not a name and an arguments object
        (``arguments`` may also be the text of one)."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if arguments is None:
            arguments = {}
        if not isinstance(name, str) or not name or not isinstance(arguments, dict):
            return None
        return cls(name, json.dumps(arguments, ensure_ascii=False))

    def as_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedOutput:
    """A model's text split into what the user reads and the tool calls it made."""

    content: str | None
    """The text outside the calls, stripped (None when nothing is left)."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls, in the order written."""


class ToolParser:
    """Finds the tool calls in one model family's text. Subclasses set :attr:`name` and
    :attr:`start_markers` and implement :meth:`parse` and :meth:`format`.

    Instances are made once per server and must not keep per-request state.
    """

    name: ClassVar[str] = ""
    """The name ``--tool-call-parser`` selects it by."""
    start_markers: ClassVar[tuple[str, ...]] = ()
    """Texts that begin the calls: while streaming, content is sent up to the first of them (and a
    marker's first characters at the end of the text are held back until they turn out otherwise)."""
    markers_at_start: ClassVar[bool] = False
    """The calls are recognised only at the start of the output (after whitespace): text that begins
    otherwise is all content, and is streamed as it comes."""
    parallel_calls: ClassVar[bool] = True
    """The format can carry several calls in one answer."""
    content_before_calls: ClassVar[bool] = True
    """The format allows text before the calls (which is returned as content)."""

    def parse(self, text: str) -> ParsedOutput:
        """Split a finished output into content and calls; never raises on model text."""
        raise NotImplementedError

    def format(self, calls: Sequence[ToolCall]) -> str:
        """The text this family's models write for ``calls`` (what :meth:`parse` reads back): used by
        the conformance suite, and to show a model its own earlier calls where its template has no
        tool support."""
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        """How many leading characters of ``text`` (an output so far) are surely content: up to the
        first start marker, less any marker prefix at its end. The server streams those and holds
        the rest until the output finishes."""
        if self.markers_at_start:
            stripped = text.lstrip()
            begins = any(m.startswith(stripped) or stripped.startswith(m) for m in self.start_markers)
            return 0 if begins or not stripped else len(text)
        cut = len(text)
        for marker in self.start_markers:
            at = text.find(marker)
            if at >= 0:
                cut = min(cut, at)
        for marker in self.start_markers:
            for size in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:size]):
                    cut = min(cut, len(text) - size)
                    break
        return cut


def json_values(text: str) -> list[Any] | None:
    """The JSON values written one after another in ``text`` (separated by whitespace, commas or
    semicolons), or None where any part is not JSON."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


__all__ = ["ParsedOutput", "ToolCall", "ToolParser", "json_values"]
