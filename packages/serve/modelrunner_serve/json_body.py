"""A request body as JSON, refused with a 400 naming the field when it is hostile.

``json.loads`` alone answers some bodies with exceptions that are no parse error (and became 500s):
an integer of thousands of digits (Python's int-string limit, a ``ValueError``), nesting deeper
than the interpreter's recursion limit (``RecursionError``), and strings holding lone surrogates
(valid JSON escapes, but no tokenizer can encode them: a ``TypeError`` later). Here every one is a
400 whose ``param`` names the field, and so are integers outside 64 bits (no token id, seed or
count is that large) and nesting deeper than :data:`MAX_JSON_DEPTH`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import APIError, bad_request, field_path

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (a chat message with an image
part needs 6)."""
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
"""Integers a request may hold: signed 64-bit."""

_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')


class _Digits(str):
    """An integer literal too long to convert (kept as its digits)."""


def load_json(raw: bytes) -> dict[str, Any]:
    """``raw`` parsed as a JSON object and checked (see the module's description).

    :raises APIError: 400 naming the field at fault (or the body, when it is not a JSON object).
    """
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8 text; send a JSON object", code="invalid_json") from None
    except json.JSONDecodeError as e:
        raise bad_request(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                          code="invalid_json") from None
    except RecursionError:
        raise _too_deep(_deep_field(raw)) from None
    except ValueError:  # an integer longer than Python converts: find it without converting
        data = json.loads(raw, parse_int=lambda s: _Digits(s) if len(s) > 20 else int(s))
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON {type(data).__name__}",
                          code="invalid_json")
    check_values(data, surrogates_possible=b"\\u" in raw or b"\xed" in raw)
    return data


def check_values(data: dict[str, Any], surrogates_possible: bool = True) -> None:
    """Check every value of a parsed body: nesting depth, integer range, valid Unicode.

    :param surrogates_possible: False when the raw body can hold no lone surrogate (no ``\\u``
        escape and no byte 0xED), which skips looking at every string.
    :raises APIError: 400 naming the field at fault.
    """
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise _too_deep(str(path[0]))
        if isinstance(value, dict):
            items = value.items()
        elif _numbers_in_range(value):
            continue
        else:
            items = enumerate(value)
        for key, item in items:
            if surrogates_possible and isinstance(key, str):
                _check_text(key, (*path, key))
            if isinstance(item, (dict, list)):
                stack.append((item, (*path, key)))
            elif isinstance(item, int) and not isinstance(item, bool):
                if not INT_MIN <= item <= INT_MAX:
                    raise _out_of_range((*path, key), str(item))
            elif isinstance(item, _Digits):
                raise _out_of_range((*path, key), item)
            elif surrogates_possible and isinstance(item, str):
                _check_text(item, (*path, key))


def _numbers_in_range(values: list[Any]) -> bool:
    """True when ``values`` holds only numbers and its integers fit 64 bits (at C speed, for the
    long token-id lists requests carry); False means: look at each item."""
    if not values or type(values[0]) is not int:
        return False
    try:
        low, high = min(values), max(values)
    except TypeError:  # not all numbers
        return False
    return INT_MIN <= low and high <= INT_MAX


def _check_text(text: str, path: tuple[Any, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        param = field_path(path)
        raise bad_request(f"{param} is not valid Unicode: character {e.start} is {text[e.start]!r}, a lone "
                          "surrogate (a \\ud800-\\udfff escape that is not half of a pair)", param=param) from None


def _out_of_range(path: tuple[Any, ...], digits: str) -> APIError:
    param = field_path(path)
    shown = digits if len(digits) <= 24 else f"an integer of {len(digits.lstrip('-'))} digits"
    return bad_request(f"{param}: {shown} is out of range; accepted: integers from {INT_MIN} to {INT_MAX}",
                       param=param)


def _too_deep(field: str | None) -> APIError:
    where = f"{field} nests" if field else "the request body nests"
    return bad_request(f"{where} arrays or objects too deeply; accepted: at most {MAX_JSON_DEPTH} levels",
                       param=field, code="invalid_value" if field else "invalid_json")


def _deep_field(raw: bytes) -> str | None:
    """The top-level field of a JSON object whose value nests deeper than :data:`MAX_JSON_DEPTH`
    (found by scanning, since such a body cannot be parsed); None if none is."""
    text = raw.decode("utf-8", "surrogatepass")
    depth, key, last = 0, None, None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif token in "]}":
            depth -= 1
        elif token == ":":
            if depth == 1 and last is not None:
                try:
                    key = json.loads(last)
                except ValueError:
                    key = None
        else:
            last = token
    return None
