"""The grammar-backend plugin kind: what turns a structured-output constraint into token masks.

A plugin declares one with ``registry.grammar_backends(MyBackend)`` in its ``register`` hook; the
engine picks it by name (config ``structured_outputs_config={"backend": NAME}``) or, with ``auto``,
asks the backends that have an :attr:`GrammarBackend.auto_order` in that order until one accepts the
request. The contract, in the order the engine calls it:

1. :meth:`GrammarBackend.check` when a request is added (cheap; raises
   :class:`~modelrunner.errors.StructuredOutputError` naming what it cannot do);
2. :meth:`GrammarBackend.compile` in a worker thread, once per distinct constraint (the engine caches
   the result by backend and :class:`GrammarSpec`);
3. :meth:`GrammarBackend.matcher` once per sequence; the matcher fills its row of the step's token
   bitmask (:meth:`GrammarBackend.fill_bitmasks` for the whole batch), accepts each sampled token,
   rolls back, and says when the grammar is complete.

A token bitmask is an int32 tensor ``[rows, ceil(vocab_size / 32)]``: bit ``j`` of word ``w`` set
means token ``32 * w + j`` may be sampled (xgrammar's and llguidance's layout). ``vocab_size`` is the
width of the model's logits, which may exceed the tokenizer's vocabulary: ids past the tokenizer's
are never allowed.
"""

from __future__ import annotations

import abc
import json
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import torch

from ..errors import StructuredOutputError
from .backend_schema import check_schema

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""Every constraint kind a request may give."""

GRAMMAR_PACKAGES = {"xgrammar": "modelrunner-grammar-xgrammar", "guidance": "modelrunner-grammar-llguidance"}
"""Backend name → the distribution that provides it, for the backends this project publishes (the
kernel ships none): what an error names when a request asks for one that is not installed."""


@attrs.frozen
class GrammarSpec:
    """One request's constraint in a backend-neutral form; with the backend's name, the key under which
    its compiled grammar is cached."""

    kind: str
    """One of :data:`CONSTRAINT_KINDS`."""
    value: str
    """``json``: the schema as JSON text (key order kept); ``regex``: the pattern; ``choice``: the
    strings as a JSON list; ``grammar``: the grammar text; ``json_object``: empty."""
    any_whitespace: bool = True
    """``json`` / ``json_object``: whether JSON whitespace may appear between tokens (False: compact)."""
    whitespace_pattern: str | None = None
    """``json`` / ``json_object``: a regex for the whitespace allowed between tokens (None: the backend's default)."""

    @classmethod
    def of(cls, params: Any, any_whitespace: bool = True) -> GrammarSpec:
        """The spec of a :class:`~modelrunner.sampling.StructuredOutputsParams`.

        :param any_whitespace: the engine's default (False when its config disables whitespace).
        """
        kind = params.kind
        if kind == "json":
            value = json.dumps(params.schema(), separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            value = json.dumps(list(params.choice), ensure_ascii=False)
        elif kind == "json_object":
            value = ""
        else:
            value = getattr(params, kind)
        return cls(kind, value, any_whitespace and not params.disable_any_whitespace, params.whitespace_pattern)

    @property
    def schema(self) -> dict[str, Any]:
        """A ``json`` spec's schema (``{"type": "object"}`` for ``json_object``)."""
        return json.loads(self.value) if self.kind == "json" else {"type": "object"}

    @property
    def choices(self) -> list[str]:
        """A ``choice`` spec's strings."""
        return json.loads(self.value)

    def describe(self, limit: int = 80) -> str:
        """``json schema {"type":...}`` — the spec in a few words, for messages."""
        text = self.value if len(self.value) <= limit else self.value[:limit - 1] + "…"
        return {"json": f"json schema {text}", "json_object": "json_object", "regex": f"regex {text!r}",
                "choice": f"choice {text}", "grammar": f"grammar {text!r}"}[self.kind]


@attrs.frozen
class GrammarContext:
    """What a backend knows of the model it serves (given once, when the engine creates it)."""

    tokenizer: Any
    """The checkpoint's Hugging Face tokenizer (a ``PreTrainedTokenizerFast`` for every checkpoint the
    kernel loads, GGUF files included)."""
    vocab_size: int
    """Width of the logits (and of the bitmask, in bits): the model's vocabulary, which may be padded
    past the tokenizer's."""
    eos_token_ids: frozenset[int]
    """Tokens that end a completion: allowed by a matcher only where its grammar may end."""


class GrammarMatcher(abc.ABC):
    """One sequence's position in a compiled grammar. Used by one thread at a time (the engine's)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` — the whole row: every bit, including
        those past the tokenizer's vocabulary (cleared). An EOS token is allowed only where the grammar
        may end."""

    @abc.abstractmethod
    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Advance over ``tokens`` (the sampled one; several for speculative decoding). False, and the
        matcher is unusable, when the grammar does not allow them."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and nothing but its end may follow (the engine then ends
        the sequence with ``finish_reason="stop"``)."""


class GrammarBackend(abc.ABC):
    """Compiles structured-output constraints into matchers of a grammar library, for one model.

    :param context: the model's tokenizer, logits width and EOS ids. The constructor must be cheap:
        build tokenizer-dependent state on first :meth:`compile` (under a lock: several compile
        threads may call it at once).
    """

    name: ClassVar[str] = "?"
    """Registry name (``structured_outputs_config={"backend": name}``)."""
    constraints: ClassVar[tuple[str, ...]] = CONSTRAINT_KINDS
    """The constraint kinds it compiles; :meth:`check` refuses the others."""
    auto_order: ClassVar[int | None] = None
    """Its place in ``backend="auto"``'s order, lowest first (xgrammar 10, guidance 20); None: used only
    when named."""
    unsupported_examples: ClassVar[tuple[dict[str, Any], ...]] = ()
    """StructuredOutputsParams keyword arguments of constraints it refuses with the feature named (its
    conformance suite checks that it does)."""

    def __init__(self, context: GrammarContext) -> None:
        self.context = context
        """The model this backend serves."""
        self.lock = threading.Lock()
        """Held while building tokenizer-dependent state (compile threads share the backend)."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why it cannot run in this environment (a library not installed), or None. ``auto`` skips
        unavailable backends; naming one fails with this reason."""
        return None

    def check(self, spec: GrammarSpec) -> None:
        """Refuse, when the request is added, what :meth:`compile` cannot do faithfully: raise
        :meth:`unsupported` naming the feature. Never accept a constraint and ignore part of it (an
        unconstrained or wrongly constrained answer is worse than a refusal). Called on the engine's
        thread: parse, do not compile. The default refuses kinds not in :attr:`constraints`, and JSON
        schemas no backend can honour (:func:`~.backend_schema.check_schema`: a ``$ref`` outside the
        schema, or no finite document satisfying it)."""
        if spec.kind not in self.constraints:
            raise self.unsupported(spec, spec.kind, f"it supports {', '.join(self.constraints)}")
        if spec.kind == "json":
            check_schema(spec.schema, self.name)

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled form of ``spec`` (anything :meth:`matcher` takes), built in a worker thread;
        the engine caches it by ``(name, spec)``. Raise :meth:`unsupported` for what :meth:`check`
        could not see."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``'s grammar (one per sequence)."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill ``bitmask[rows[i]]`` from ``matchers[i]`` for every constrained row of a step that uses
        this backend, in one call (override to fill them in parallel). The default loops."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Mask ``logits`` in place with ``bitmask`` (see :func:`apply_bitmask`, the default). Override
        with a faster kernel of the backend's library; it must give the same result, on rows of any
        backend (the engine masks a step's rows in one call, whichever backends filled them)."""
        apply_bitmask(logits, bitmask, rows)

    def unsupported(self, spec: GrammarSpec, feature: str, detail: str = "") -> StructuredOutputError:
        """The error that refuses ``feature`` of ``spec`` (raise it), naming this backend."""
        message = f"grammar backend {self.name!r} does not support {feature} (in {spec.describe()})"
        return StructuredOutputError(message + (f": {detail}" if detail else ""), feature=feature, backend=self.name)

    def __repr__(self) -> str:
        return f"<grammar backend {self.name!r}>"


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[rows, bitmask_words(vocab_size)]`` int32 bitmask with every token disallowed."""
    return torch.zeros(rows, bitmask_words(vocab_size), dtype=torch.int32)


# Byte value -> its 8 bits, least significant first: on a little-endian machine the bytes of an int32
# word, read in memory order, hold tokens 32w + 0..7, 8..15, 16..23, 24..31 (one table lookup per byte
# is many times faster than shifting every word 32 times).
_ALLOWED = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_BLOCKED = ~_ALLOWED


def _unpack(table: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    if sys.byteorder != "little":
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)
        return (bits if table is _ALLOWED else ~bits)[:, :vocab_size]
    data = bitmask.contiguous().view(torch.uint8).reshape(-1).int()
    return table.to(bitmask.device).index_select(0, data).reshape(bitmask.shape[0], -1)[:, :vocab_size]


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[rows, vocab_size]`` booleans, True where ``bitmask`` allows the token."""
    return _unpack(_ALLOWED, bitmask, vocab_size)


def bitmask_from_allowed(allowed: Sequence[int], vocab_size: int) -> torch.Tensor:
    """One ``[bitmask_words(vocab_size)]`` int32 row allowing exactly the token ids ``allowed``."""
    flags = torch.zeros(bitmask_words(vocab_size) * 32, dtype=torch.int64)
    if len(allowed):
        flags[torch.as_tensor(list(allowed), dtype=torch.long)] = 1
    words = (flags.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids one bitmask row allows."""
    return bitmask_to_bool(bitmask_row.reshape(1, -1), vocab_size)[0].nonzero().flatten().tolist()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set to -inf, in place, the tokens of ``logits[r]`` that ``bitmask[r]`` disallows, for each ``r``
    in ``rows`` (the other rows are left alone), with torch. The engine calls a backend's
    :meth:`GrammarBackend.apply_bitmask`, which is this unless the backend has a faster kernel."""
    rows = list(rows)
    index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
    blocked = _unpack(_BLOCKED, bitmask.index_select(0, index.cpu()), logits.shape[1]).to(logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, float("-inf"))
        return
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(blocked, float("-inf")))


_VOCABULARIES: dict[tuple[int, int], tuple[Any, list[str | None]]] = {}
_VOCABULARY_LOCK = threading.Lock()


def decoded_vocabulary(context: GrammarContext) -> list[str | None]:
    """Per token id below ``context.vocab_size``, the text the token adds to a completion; None for
    special tokens, ids past the tokenizer's vocabulary and tokens that are not whole UTF-8 characters
    on their own. Computed once per tokenizer (a second or so for 50k tokens) — for backends that
    match text rather than bytes."""
    key = (id(context.tokenizer), context.vocab_size)
    with _VOCABULARY_LOCK:
        found = _VOCABULARIES.get(key)
        if found is not None:
            return found[1]
        tokenizer = context.tokenizer
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        size = min(len(tokenizer), context.vocab_size)
        # The text a token adds after a prefix, so leading spaces survive decoders that strip them.
        anchor = tokenizer.encode("a", add_special_tokens=False)
        base = tokenizer.decode(anchor)
        out: list[str | None] = [None] * context.vocab_size
        for token in range(size):
            if token in special:
                continue
            text = tokenizer.decode(anchor + [token])
            piece = text[len(base):] if text.startswith(base) else tokenizer.decode([token])
            out[token] = None if "\ufffd" in piece or not piece else piece
        _VOCABULARIES[key] = (tokenizer, out)  # the tokenizer kept alive, so its id is not reused
        return out


__all__ = ["CONSTRAINT_KINDS", "GRAMMAR_PACKAGES", "GrammarBackend", "GrammarContext", "GrammarMatcher", "GrammarSpec",
           "allocate_bitmask", "allowed_token_ids", "apply_bitmask", "bitmask_from_allowed", "bitmask_to_bool",
           "bitmask_words", "decoded_vocabulary"]
