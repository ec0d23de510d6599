"""What every grammar backend checks of a JSON schema before compiling it: that its ``$ref``s stay
inside the schema, and that some finite document satisfies it.

Grammar libraries differ on schemas that cannot be honoured: xgrammar treats a remote ``$ref`` as
"any JSON" and compiles ``{"type": "string", "const": 5}`` or ``{"anyOf": []}`` into grammars whose
documents break the schema; a ``$ref`` cycle with no way out, or a required property that contains
itself, has no finite document at all (generation could only fail). :func:`schema_problem` finds
these before any backend sees the schema, so a request gets a clear refusal instead of an answer
that breaks its schema or a failure half-way.

The satisfiability check is conservative: it reports a schema only where the keywords it reads
(``$ref``, ``type``, ``const``, ``enum``, ``anyOf``/``oneOf``/``allOf``, ``required`` with
``properties``/``additionalProperties``, ``items``/``prefixItems`` with ``minItems``, and the
``min*``/``max*`` bounds) prove that nothing matches; the backends enforce the rest.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import StructuredOutputError

MATCHES_NOTHING = "a constraint that matches nothing"
"""``StructuredOutputError.feature`` of a constraint no text satisfies (a server answers 400 ``invalid_value``)."""
REMOTE_REF = "remote $ref"
"""``StructuredOutputError.feature`` of a ``$ref`` outside the schema (never fetched: refused)."""
JSON_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
"""JSON schema's type names."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def subschemas(node: Any, where: str) -> Iterator[tuple[Any, str]]:
    """``(subschema, its JSON pointer)`` for each schema directly inside ``node`` (not through ``$ref``)."""
    if not isinstance(node, dict):
        return
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, f"{where}/{key}/{escape_pointer(str(name))}"
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key], f"{where}/{key}"
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, f"{where}/{key}/{i}"


def map_subschemas(node: Any, change: Callable[[Any], Any]) -> Any:
    """A shallow copy of schema ``node`` with each schema directly inside it replaced by ``change(it)``
    (values such as ``enum``, ``const`` or ``default`` are left alone)."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: change(sub) for name, sub in node[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(node.get(key), (dict, bool)):
            out[key] = change(node[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [change(sub) for sub in node[key]]
    return out


def escape_pointer(name: str) -> str:
    """``name`` as one JSON-pointer segment (``~`` → ``~0``, ``/`` → ``~1``)."""
    return name.replace("~", "~0").replace("/", "~1")


def resolve_ref(root: Any, ref: str) -> tuple[bool, Any]:
    """``(found, target)`` of a local ``$ref`` (``#`` or a JSON pointer ``#/...``) in ``root``."""
    if ref == "#":
        return True, root
    node = root
    for raw in ref[2:].split("/"):
        part = urllib.parse.unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _refs(root: Any) -> Iterator[tuple[str, str]]:
    """``(ref, where)`` of every ``$ref`` string in ``root``'s schemas."""
    stack = [(root, "#")]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            yield node["$ref"], where
        stack.extend(subschemas(node, where))


def _types_of(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number", "integer"} if value.is_integer() else {"number"}
    if isinstance(value, str):
        return {"string"}
    return {"array"} if isinstance(value, list) else {"object"} if isinstance(value, dict) else set()


def _number(node: dict, key: str) -> float | None:
    value = node.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _Checker:
    """The least fixpoint of "has a finite document" over a schema's ``$ref`` targets, then the
    reason (or None) for the root."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.satisfiable: dict[str, bool] = {}

    def run(self) -> str | None:
        refs = sorted({ref for ref, _ in _refs(self.root)})
        targets = {ref: resolve_ref(self.root, ref)[1] for ref in refs}
        users: dict[str, set[str]] = {ref: set() for ref in refs}
        for ref in refs:
            for used, _ in _refs(targets[ref]):
                if used in users:
                    users[used].add(ref)
        self.satisfiable = dict.fromkeys(refs, False)
        pending = list(refs)
        while pending:  # each ref turns satisfiable at most once: a worklist, not rounds
            ref = pending.pop()
            if not self.satisfiable[ref] and self.problem(targets[ref], ref) is None:
                self.satisfiable[ref] = True
                pending.extend(users[ref])
        return self.problem(self.root, "#")

    def problem(self, node: Any, where: str) -> str | None:
        """Why no document satisfies ``node`` (None: one may)."""
        if node is False:
            return f"{where} is the schema false, which nothing satisfies"
        if not isinstance(node, dict):
            return None
        ref = node.get("$ref")
        if isinstance(ref, str) and not self.satisfiable.get(ref, False):
            return (f"{where}: $ref {ref!r} has no finite document (it leads back to itself with no way out, or to a "
                    f"schema nothing satisfies)")
        for sub, at in ((s, f"{where}/allOf/{i}") for i, s in enumerate(node.get("allOf") or ())):
            found = self.problem(sub, at)
            if found:
                return found
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list):
                if not branches:
                    return f"{where}/{key} is an empty list, which nothing satisfies"
                reasons = [self.problem(sub, f"{where}/{key}/{i}") for i, sub in enumerate(branches)]
                if all(reasons):
                    return f"{where}/{key}: no branch can be satisfied ({reasons[0]})"
        declared = node.get("type")
        allowed = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) \
            else set(JSON_TYPES)
        if isinstance(declared, list) and not declared:
            return f"{where}/type is an empty list, which nothing satisfies"
        if "number" in allowed:  # integers are numbers
            allowed.add("integer")
        if "const" in node:
            if not _types_of(node["const"]) & allowed:
                return f"{where}: const {node['const']!r:.60} is not of type {declared!r}"
            if isinstance(node.get("enum"), list) and node["const"] not in node["enum"]:
                return f"{where}: const {node['const']!r:.60} is not one of its enum"
            return None
        if isinstance(node.get("enum"), list):
            if not any(_types_of(v) & allowed for v in node["enum"]):
                return (f"{where}: enum is empty, which nothing satisfies" if not node["enum"] else
                        f"{where}: no value of enum is of type {declared!r}")
            return None
        reasons = [self._type_problem(node, kind, where) for kind in JSON_TYPES if kind in allowed]
        return reasons[0] if reasons and all(reasons) else None

    def _type_problem(self, node: dict, kind: str, where: str) -> str | None:
        bounds = {"string": ("minLength", "maxLength"), "array": ("minItems", "maxItems"),
                  "object": ("minProperties", "maxProperties")}.get(kind)
        if bounds:
            low, high = _number(node, bounds[0]), _number(node, bounds[1])
            if low is not None and high is not None and low > high:
                return f"{where}: {bounds[0]} ({low:g}) is greater than {bounds[1]} ({high:g})"
        if kind in ("number", "integer"):
            return self._number_problem(node, kind, where)
        if kind == "array":
            return self._array_problem(node, where)
        if kind == "object":
            return self._object_problem(node, where)
        return None

    @staticmethod
    def _number_problem(node: dict, kind: str, where: str) -> str | None:
        low, high = _number(node, "minimum"), _number(node, "maximum")
        low_open, high_open = _number(node, "exclusiveMinimum"), _number(node, "exclusiveMaximum")
        lo = max((v for v in (low, low_open) if v is not None), default=-math.inf)
        hi = min((v for v in (high, high_open) if v is not None), default=math.inf)
        lo_excl = low_open is not None and low_open >= (low if low is not None else -math.inf)
        hi_excl = high_open is not None and high_open <= (high if high is not None else math.inf)
        if kind == "integer":
            first = math.floor(lo) + 1 if lo_excl and lo == math.floor(lo) else math.ceil(lo) if lo > -math.inf else lo
            last = math.ceil(hi) - 1 if hi_excl and hi == math.ceil(hi) else math.floor(hi) if hi < math.inf else hi
            if first > last:
                return f"{where}: no integer lies between the schema's minimum and maximum"
        elif lo > hi or (lo == hi and (lo_excl or hi_excl)):
            return f"{where}: no number lies between the schema's minimum and maximum"
        return None

    def _array_problem(self, node: dict, where: str) -> str | None:
        needed = int(_number(node, "minItems") or 0)
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else \
            node.get("items") if isinstance(node.get("items"), list) else []
        for i in range(min(needed, len(prefix))):
            found = self.problem(prefix[i], f"{where}/prefixItems/{i}")
            if found:
                return found
        rest = node.get("items") if not isinstance(node.get("items"), list) else node.get("additionalItems", True)
        if needed > len(prefix):
            return self.problem(rest, f"{where}/items")
        return None

    def _object_problem(self, node: dict, where: str) -> str | None:
        required = node.get("required") if isinstance(node.get("required"), list) else []
        most = _number(node, "maxProperties")
        if most is not None and len(set(map(str, required))) > most:
            return f"{where}: {len(required)} properties are required but maxProperties is {most:g}"
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        for name in required:
            if name in properties:
                found = self.problem(properties[name], f"{where}/properties/{escape_pointer(str(name))}")
            elif not node.get("patternProperties"):
                found = (f"{where}: required property {name!r} is not allowed (additionalProperties is false)"
                         if extra is False else self.problem(extra, f"{where}/additionalProperties"))
            else:
                found = None
            if found:
                return found
        return None


def schema_problem(schema: Any) -> tuple[str, str] | None:
    """``(feature, message)`` of what makes a JSON schema impossible to honour, or None: a ``$ref``
    that is not a JSON pointer into the schema (:data:`REMOTE_REF` for one that points elsewhere:
    nothing is ever fetched), one that does not resolve, or no finite document satisfying it
    (:data:`MATCHES_NOTHING`). The message names the place (``#/properties/a``) and the reason."""
    for ref, where in _refs(schema):
        if not (ref == "#" or ref.startswith("#/")):
            kind = "points outside the schema" if not ref.startswith("#") else "is not a JSON pointer ('#/...')"
            return REMOTE_REF, (f"{where}: $ref {ref!r:.120} {kind}; references are never fetched: put the schema "
                                f"under $defs and refer to it as '#/$defs/NAME'")
        if not resolve_ref(schema, ref)[0]:
            return MATCHES_NOTHING, f"{where}: $ref {ref!r:.120} does not resolve to anything in the schema"
    problem = _Checker(schema).run()
    return None if problem is None else (MATCHES_NOTHING, f"no document satisfies the schema: {problem}")


def check_schema(schema: Any, backend: str | None = None) -> None:
    """Raise :class:`~modelrunner.errors.StructuredOutputError` for a schema :func:`schema_problem` refuses."""
    found = schema_problem(schema)
    if found is not None:
        raise StructuredOutputError(found[1], feature=found[0], backend=backend)


__all__ = ["JSON_TYPES", "MATCHES_NOTHING", "REMOTE_REF", "check_schema", "escape_pointer", "map_subschemas",
           "resolve_ref", "schema_problem", "subschemas"]
