"""Structured outputs: grammar backends (a plugin kind) and the engine's use of them.

A request constrains its output with ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``;
a grammar backend (:class:`GrammarBackend`, declared with ``registry.grammar_backends``) compiles the
constraint and its matchers mask each step's logits. The kernel ships ``xgrammar`` (the default) and
``guidance`` (llguidance).
"""

from .backend import (CONSTRAINT_KINDS, GrammarBackend, GrammarContext, GrammarMatcher, GrammarSpec, allocate_bitmask,
                      allowed_token_ids, apply_bitmask, bitmask_from_allowed, bitmask_to_bool, bitmask_words,
                      decoded_vocabulary)

__all__ = [
    "CONSTRAINT_KINDS",
    "GrammarBackend",
    "GrammarContext",
    "GrammarMatcher",
    "GrammarSpec",
    "allocate_bitmask",
    "allowed_token_ids",
    "apply_bitmask",
    "bitmask_from_allowed",
    "bitmask_to_bool",
    "bitmask_words",
    "decoded_vocabulary",
]
