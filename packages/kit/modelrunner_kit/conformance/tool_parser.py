"""The tool-parser suite: what the server relies on when it reads tool calls out of a model's text.

The parser's own :meth:`~modelrunner.tool_parser.ToolParser.format` writes example calls the way its
model family does; the suite checks that :meth:`~modelrunner.tool_parser.ToolParser.parse` reads them
back (names and arguments as JSON), that plain text stays content, that text it cannot read as calls
stays content without raising, and that streaming never sends part of a call as content nor holds
back content for good.
"""

from __future__ import annotations

import json
from typing import Any

from .base import Check, ConformanceError, NotApplicable, Suite, expect

EXAMPLE_CALLS = (
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("search", {"query": "tour \"Eiffel\" — hauteur", "limit": 3, "filters": {"lang": ["fr", "en"]}}),
    ("ping", {}),
)
"""Calls the suite writes through the parser's ``format`` and reads back: nested values, quotes,
non-ASCII text and empty arguments."""

PLAIN = "The weather in Paris is mild today; take a light jacket {just in case}."
"""An answer without calls (braces and semicolons included)."""


class ToolParserSuite(Suite):
    """Checks one tool-call parser on the calls its own ``format`` writes."""

    kind = "tool_parsers"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self._parser: Any = None

    def parser(self) -> Any:
        """An instance of the parser under test (made once)."""
        if self._parser is None:
            self._parser = self.plugins.registry.get_class(self.kind, self.name, self.provider())()
        return self._parser

    def _calls(self, count: int) -> list[Any]:
        from modelrunner.api import ToolCall

        return [ToolCall(name, json.dumps(arguments)) for name, arguments in EXAMPLE_CALLS[:count]]

    def _read_back(self, text: str, calls: list[Any], content: str | None) -> None:
        parsed = self.parser().parse(text)
        got = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
        want = [(c.name, json.loads(c.arguments)) for c in calls]
        expect(got == want, f"parse({text!r}) gave calls {got}, expected {want}")
        expect(parsed.content == content, f"parse({text!r}) gave content {parsed.content!r}, expected {content!r}")
        ids = [c.id for c in parsed.tool_calls]
        expect(len(set(ids)) == len(ids) and all(isinstance(i, str) and i for i in ids),
               f"call ids must be distinct non-empty strings, got {ids}")

    def _check_one_call(self) -> None:
        calls = self._calls(1)
        self._read_back(self.parser().format(calls), calls, None)

    def _check_several_calls(self) -> None:
        if not self.parser().parallel_calls:
            raise NotApplicable("the parser declares parallel_calls = False")
        calls = self._calls(len(EXAMPLE_CALLS))
        self._read_back(self.parser().format(calls), calls, None)

    def _check_content_before_calls(self) -> None:
        if not self.parser().content_before_calls:
            raise NotApplicable("the parser declares content_before_calls = False")
        calls = self._calls(1)
        self._read_back("Let me look that up.\n" + self.parser().format(calls), calls, "Let me look that up.")

    def _check_plain_text(self) -> None:
        self._read_back(PLAIN, [], PLAIN)
        self._read_back("", [], None)

    def _check_unreadable_calls(self) -> None:
        parser = self.parser()
        text = parser.format(self._calls(1))
        for broken in (text[: len(text) // 2], text.replace('"get_weather"', "get_weather"),
                       *(m + " {not json" for m in parser.start_markers)):
            try:
                parsed = parser.parse(broken)
            except Exception as e:  # noqa: BLE001 - the contract: never raise on model text
                raise ConformanceError(f"parse({broken!r}) raised {type(e).__name__}: {e}") from None
            expect(not parsed.tool_calls or all(json.loads(c.arguments) is not None for c in parsed.tool_calls),
                   f"parse({broken!r}) returned calls whose arguments are not JSON")
            if not parsed.tool_calls:
                expect(parsed.content == (broken.strip() or None),
                       f"parse({broken!r}) dropped text it could not read as calls: content {parsed.content!r}")

    def _check_streaming(self) -> None:
        parser = self.parser()
        outputs = [PLAIN, parser.format(self._calls(1))]
        if parser.content_before_calls:
            outputs.append("Sure — checking.\n" + parser.format(self._calls(2 if parser.parallel_calls else 1)))
        for text in outputs:
            final = parser.parse(text)
            sent = 0
            for end in range(len(text) + 1):
                safe = parser.streamable(text[:end])
                expect(0 <= safe <= end, f"streamable({text[:end]!r}) = {safe}, outside 0..{end}")
                sent = max(sent, safe)
                streamed = text[:sent]
                if final.tool_calls:
                    expect(final.content is None or streamed.strip() in final.content or not streamed.strip(),
                           f"streaming {text!r} sent {streamed!r}, which is not content")
                    expect(not any(m in streamed for m in parser.start_markers if m.strip()),
                           f"streaming {text!r} sent a call's start as content: {streamed!r}")
            if not final.tool_calls:
                expect(parser.streamable(text) == len(text) or final.content is None,
                       f"streaming held back content of an answer without calls: {text!r}")

    def checks(self) -> list[Check]:
        """Read back one call, several, content before them, plain text, unreadable calls, streaming."""
        return [Check("one-call", self._check_one_call), Check("several-calls", self._check_several_calls),
                Check("content-before-calls", self._check_content_before_calls),
                Check("plain-text", self._check_plain_text), Check("unreadable-calls", self._check_unreadable_calls),
                Check("streaming", self._check_streaming)]


__all__ = ["EXAMPLE_CALLS", "ToolParserSuite"]
