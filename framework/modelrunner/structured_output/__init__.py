"""Structured outputs: grammar backends (a plugin kind) and the engine's use of them.

A request constrains its output with ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``;
a grammar backend (:class:`GrammarBackend`, declared with ``registry.grammar_backends``) compiles the
constraint and its matchers mask each step's logits. The kernel ships none: ``xgrammar`` (the default)
comes with the ``modelrunner-grammar-xgrammar`` distribution and ``guidance`` (llguidance) with
``modelrunner-grammar-llguidance`` (:data:`GRAMMAR_PACKAGES`).
"""

from .backend import (CONSTRAINT_KINDS, GRAMMAR_PACKAGES, GrammarBackend, GrammarContext, GrammarMatcher, GrammarSpec,
                      allocate_bitmask, allowed_token_ids, apply_bitmask, bitmask_from_allowed, bitmask_to_bool,
                      bitmask_words, decoded_vocabulary)
from .backend_schema import MATCHES_NOTHING, REMOTE_REF, check_schema

__all__ = [
    "CONSTRAINT_KINDS",
    "GRAMMAR_PACKAGES",
    "GrammarBackend",
    "GrammarContext",
    "GrammarMatcher",
    "GrammarSpec",
    "MATCHES_NOTHING",
    "REMOTE_REF",
    "allocate_bitmask",
    "allowed_token_ids",
    "apply_bitmask",
    "bitmask_from_allowed",
    "bitmask_to_bool",
    "bitmask_words",
    "check_schema",
    "decoded_vocabulary",
]
