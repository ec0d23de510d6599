"""A request's structured-output fields → :class:`~modelrunner.sampling_params.StructuredOutputsParams`.

Three spellings constrain a completion: OpenAI's ``response_format`` (``json_object``, or
``json_schema`` with a ``schema``), vLLM's ``structured_outputs`` extra (a dict of
StructuredOutputsParams' fields) and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (with ``guided_whitespace_pattern`` and a per-request
``guided_decoding_backend``, which are ignored when no constraint is given, as vLLM ignores them). A
request gives at most one of them. The constraint is checked — and compiled by the grammar backend —
before the request is queued, so a schema the backend cannot serve, one that points outside itself
(a remote ``$ref``, never fetched) and a constraint that no text satisfies (a regex or grammar that
matches nothing, a ``$ref`` cycle with no way out, ``const`` against ``type``, ``anyOf: []``) are a 400
naming the request field and the reason, never a 500, an unconstrained answer or one that breaks it.
"""

from __future__ import annotations

import warnings
from typing import Any

from modelrunner.errors import StructuredOutputError
from modelrunner.sampling.structured import GuidedDecodingParams, StructuredOutputsParams, as_structured_outputs
from modelrunner.structured_output.backend_schema import MATCHES_NOTHING, schema_problem
from .errors import APIError, bad_request

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
"""vLLM's older request fields → the StructuredOutputsParams field each sets."""
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
"""Accepted ``response_format.type`` values."""


def structured_outputs_of(body: Any) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint a request body asks for (None: none) and the request field it came from.

    :raises APIError: 400 naming the field: several spellings at once, an unknown ``response_format``
        type, ``json_schema`` without a schema, or parameters StructuredOutputsParams refuses.
    """
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
             if getattr(body, name, None) is not None and not (name == "response_format" and _is_text(body))]
    if len(given) > 1:
        raise bad_request(f"{given[0]} and {given[1]} both constrain the output; give one", param=given[1])
    extras = {"whitespace_pattern": getattr(body, "guided_whitespace_pattern", None)}
    backend = getattr(body, "guided_decoding_backend", None)
    if not given:  # they tune a constraint; without one they have nothing to do (vLLM ignores them too)
        return None, ""
    field = given[0]
    try:
        if field == "response_format":
            values = _response_format(body.response_format)
        elif field == "structured_outputs":
            values = dict(body.structured_outputs)
            if backend is None and not extras["whitespace_pattern"]:
                return as_structured_outputs(values), field  # its message names an unknown key
        else:
            values = {GUIDED_FIELDS[field]: getattr(body, field)}
        values.update({k: v for k, v in extras.items() if v is not None})
        if backend is not None:
            with warnings.catch_warnings():  # the deprecated class is the one that carries a backend
                warnings.simplefilter("ignore", DeprecationWarning)
                return GuidedDecodingParams(backend=backend, **values), field
        return StructuredOutputsParams(**values), field
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e}", param=field) from None
    except TypeError as e:  # an unknown key in structured_outputs
        raise bad_request(f"{field}: {e}", param=field) from None


def _is_text(body: Any) -> bool:
    return isinstance(body.response_format, dict) and body.response_format.get("type") == "text"


def _response_format(value: dict[str, Any]) -> dict[str, Any]:
    kind = value.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:  # OpenAI's key; vLLM's older clients also sent json_schema.json_schema
            schema = spec.get("json_schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema is required with type 'json_schema': "
                              "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
                              param="response_format.json_schema.schema")
        return {"json": schema}
    raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}; got {kind!r}",
                      param="response_format.type")


async def constrain(served: Any, params: Any, constraint: StructuredOutputsParams | None, field: str) -> None:
    """Set ``params.structured_outputs`` to ``constraint`` once the grammar backend has compiled it
    (off the event loop); nothing for None.

    :raises APIError: 400 naming ``field`` (see :func:`check_compiles`).
    """
    if constraint is None:
        return
    from starlette.concurrency import run_in_threadpool

    await run_in_threadpool(check_compiles, served.llm, constraint, field)
    params.structured_outputs = constraint


def check_compiles(llm: Any, params: StructuredOutputsParams, field: str) -> None:
    """Have the engine's grammar backend accept and compile ``params`` now (call it off the event
    loop): the request's own add then finds it compiled in the cache.

    :raises APIError: 400 naming ``field`` and the feature the backend refuses or cannot compile (in
        ``structured_outputs_compile_timeout_s`` from when its compilation started); 503 with
        Retry-After when the grammar compile pool is too busy to take it (the message says how busy).
    """
    if params.kind == "json":  # before any backend: the same refusal whichever would have compiled it
        found = schema_problem(params.schema())
        if found is not None:
            raise bad_request(f"{field}: {found[1]}", param=field, code=_code(found[0]))
    manager = getattr(getattr(llm, "engine", None), "structured_outputs", None)
    if manager is None:  # an engine without a manager refuses the request when it is added
        return
    from modelrunner.structured_output.manager import GrammarPoolBusy

    try:  # waits at most structured_outputs_compile_timeout_s from when its compilation starts
        manager.wait_compiled(manager.prepare(params))
    except GrammarPoolBusy as e:  # the server is busy, not the request wrong: retry
        raise APIError(503, f"{field}: {e}", param=field, code="grammar_pool_busy",
                       headers={"Retry-After": "1"}) from None
    except StructuredOutputError as e:
        raise bad_request(f"{field}: {e}", param=field, code=_code(e.feature)) from None


def _code(feature: str | None) -> str:
    """The error code of a refused constraint: ``invalid_value`` for one no text satisfies (or whose
    ``$ref`` does not resolve), ``unsupported`` for a feature the backends do not serve."""
    return "invalid_value" if feature == MATCHES_NOTHING else "unsupported"


__all__ = ["GUIDED_FIELDS", "RESPONSE_FORMATS", "check_compiles", "constrain", "structured_outputs_of"]
