"""The names plugins provide, one registry per kind, and who provides each name.

A plugin's ``register`` hook declares its names here once; the kernel then routes every hook call
for a name to the plugin that declared it (see :class:`modelrunner.plugins.Plugins`). Names of the
kernel's own default plugins lose to the same name from an installed plugin; two installed plugins
declaring one name is a *conflict*, resolved only by an explicit choice (``adapter=NAME`` for an
architecture, ``plugin:name`` for the other kinds), never by install order.
"""

from __future__ import annotations

import importlib
from typing import Any

import attrs

from .errors import PluginConflictError, did_you_mean

NAME_KINDS = ("architectures", "allocators", "compile_backends")
"""Kinds declared by name only (the plugin's hook answers for them)."""
CLASS_KINDS = ("attention_backends", "logits_processors", "quantization_methods", "matmul_kernels",
               "grammar_backends", "tool_parsers", "proposers", "lora_kernels",
               "executors", "pooling_methods")
"""Kinds declared by class (the class's ``name`` attribute is the name; the kernel instantiates it)."""
KINDS = NAME_KINDS + CLASS_KINDS
"""Every kind of name a plugin may provide."""

CAPABILITIES: dict[str, dict[str, Any]] = {
    "architectures": {"tensor_parallel": None, "pipeline_parallel": None, "quantization": None, "devices": None,
                      "attention_backends": None, "model_type": None},
    "compile_backends": {"devices": None, "tensor_parallel": None, "pipeline_parallel": None},
    "allocators": {"prefix_caching": None},
}
"""What a name-kind plugin may declare about each name (``registry.architectures("X", tensor_parallel=True)``):
capability → its value when undeclared (None: not declared, so nothing is refused for it).

- ``tensor_parallel`` / ``pipeline_parallel``: runs with ``tensor_parallel_size`` / ``pipeline_parallel_size`` > 1.
- ``quantization``: the quantization methods the adapter runs (``("*",)``: every method, because the
  model is built from the kernel's layers; ``("none",)``: dense weights only).
- ``devices``: device types (``"cpu"``, ``"cuda"``) it runs on.
- ``attention_backends``: whether the adapter's layers run the configured attention backend
  (``attention_backend`` applies; ``False`` for a model with its own attention, like transformers').
- ``model_type``: the config ``model_type`` of checkpoints of an architecture transformers has no
  class of that name for (``"llama"`` for a Llama-shaped ``MyForCausalLM``): the adapter conformance
  suite builds its tiny checkpoint, and transformers its reference model, from it.
- ``prefix_caching``: the allocator reuses cached prompt prefixes.
"""
CLASS_CAPABILITIES = {
    "attention_backends": ("max_block_size", "supports_sliding_window", "dtypes"),
    "quantization_methods": ("devices", "tensor_parallel"),
    "logits_processors": ("builtin", "order"),
    "matmul_kernels": ("layout", "devices", "exact", "activations", "timed"),
    "grammar_backends": ("constraints", "auto_order"),
    "tool_parsers": ("start_markers", "parallel_calls"),
    "proposers": (),
    "lora_kernels": ("devices",),
    "executors": ("parallel", "launched_externally"),
    "pooling_methods": ("reads",),
}
"""Class kinds: the class attributes that are their capabilities (shown by ``plugins --matrix``)."""

PROJECT_NAMES: dict[str, dict[str, str]] = {
    "quantization_methods": dict.fromkeys(("gguf", "int8", "int4"), "modelrunner-quantization"),
    "matmul_kernels": dict.fromkeys(("reference", "int8_rowwise", "torch_int4pack", "torch_int8pack", "onednn_bf16",
                                     "onednn_bf16_int4pack"), "modelrunner-quantization"),
    "proposers": {"ngram": "modelrunner-speculative", "draft": "modelrunner-proposer-draft"},
    "lora_kernels": {"torch": "modelrunner-lora"},
    "tool_parsers": dict.fromkeys(("hermes", "llama3_json", "mistral"), "modelrunner-serve"),
    "executors": {"mp": "modelrunner-executor-mp", "torchrun": "modelrunner-executor-mp",
                  "ray": "modelrunner-executor-ray"},
}
"""kind → name → the distribution of this project that provides it outside the kernel, so that an
unknown name says what to install (the kernel never imports them)."""

FALLBACK_ARCHITECTURE = "AutoModelForCausalLM"
"""The architecture name a generic adapter registers: its load hook is asked for any checkpoint whose
architecture no plugin registered."""


def split_choice(name: str) -> tuple[str | None, str]:
    """``"plugin:name"`` → ``("plugin", "name")``; a plain ``"name"`` → ``(None, "name")``."""
    plugin, sep, rest = name.partition(":")
    return (plugin, rest) if sep and plugin and rest else (None, name)


BASE_CLASSES = {
    "attention_backends": "modelrunner.layers.attention_backend:AttentionBackend",
    "logits_processors": "modelrunner.sampling.logits_processor:LogitsProcessor",
    "quantization_methods": "modelrunner.quantization.base:QuantizationMethod",
    "matmul_kernels": "modelrunner.quantization.matmul:MatmulKernel",
    "grammar_backends": "modelrunner.structured_output.backend:GrammarBackend",
    "tool_parsers": "modelrunner.tool_parser:ToolParser",
    "proposers": "modelrunner.spec_decode.proposer:Proposer",
    "lora_kernels": "modelrunner.lora.kernel:LoRAKernel",
    "executors": "modelrunner.executor_base:Executor",
    "pooling_methods": "modelrunner.pooling.method:PoolingMethod",
}
"""Class kind → ``module:Class`` of the base class its plugins subclass (all in :mod:`modelrunner.api`).
Resolved on use: the registry sits below the packages that define them."""


def base_class(kind: str) -> type:
    """The base class the plugins of class kind ``kind`` subclass.

    :raises KeyError: ``kind`` is not a class kind.
    """
    module, _, name = BASE_CLASSES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


@attrs.define
class Registry:
    """Collects names through the ``register`` hook, remembering every plugin behind each.

    :param default_plugins: the kernel's own plugins (their names lose to installed plugins').
    """

    default_plugins: frozenset[str] = frozenset()
    """The kernel's own plugins."""
    providers: dict[str, dict[str, list[str]]] = attrs.field(factory=lambda: {k: {} for k in KINDS})
    """kind → name → the plugins that declared it, in registration order."""
    classes: dict[tuple[str, str, str], type] = attrs.field(factory=dict)
    """``(kind, name, plugin)`` → the class a plugin declared for a class kind."""
    declared: dict[tuple[str, str, str], dict[str, Any]] = attrs.field(factory=dict)
    """``(kind, name, plugin)`` → the capabilities a plugin declared for a name kind."""
    current_plugin: str = "?"
    """The plugin whose ``register`` hook is running (set by the plugin manager)."""

    # -- declaring (called from register hooks) ------------------------------------------------

    def _add(self, kind: str, name: Any) -> None:
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"plugin {self.current_plugin!r} registered an invalid {kind} name {name!r} "
                             "(a non-empty string without ':')")
        plugins = self.providers[kind].setdefault(name, [])
        if self.current_plugin not in plugins:
            plugins.append(self.current_plugin)

    def _add_classes(self, kind: str, classes: tuple[type, ...]) -> None:
        base = base_class(kind)
        for cls in classes:
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise ValueError(f"plugin {self.current_plugin!r} registered {cls!r} as one of its {kind}; "
                                 f"expected a {base.__module__}.{base.__name__} subclass")
            self._add(kind, getattr(cls, "name", None))
            self.classes[(kind, cls.name, self.current_plugin)] = cls

    def _declare(self, kind: str, names: tuple[str, ...], capabilities: dict[str, Any]) -> None:
        known = CAPABILITIES[kind]
        unknown = sorted(set(capabilities) - set(known))
        if unknown:
            raise ValueError(f"plugin {self.current_plugin!r} declared unknown {kind} capability {unknown[0]!r}"
                             f"{did_you_mean(unknown[0], known)} (known: {', '.join(known)})")
        for key in ("quantization", "devices"):
            if isinstance(capabilities.get(key), str):
                capabilities[key] = (capabilities[key],)
        for name in names:
            self._add(kind, name)
            self.declared[(kind, name, self.current_plugin)] = {**known, **capabilities}

    def architectures(self, *names: str, **capabilities: Any) -> None:
        """Declare model architectures (HF ``architectures`` entries) the plugin's load hook accepts,
        with what the adapter supports (see :data:`CAPABILITIES`: ``tensor_parallel``,
        ``pipeline_parallel``, ``quantization``, ``devices``, ``attention_backends``, ``model_type``)."""
        self._declare("architectures", names, capabilities)

    def allocators(self, *names: str, **capabilities: Any) -> None:
        """Declare KV-cache allocator names the plugin's allocate hook answers (``prefix_caching=``)."""
        self._declare("allocators", names, capabilities)

    def compile_backends(self, *names: str, **capabilities: Any) -> None:
        """Declare compile backend names the plugin's compile hook answers (``devices=``,
        ``tensor_parallel=``, ``pipeline_parallel=``)."""
        self._declare("compile_backends", names, capabilities)

    def attention_backends(self, *backends: type) -> None:
        """Declare paged-attention implementations (:class:`modelrunner.layers.AttentionBackend`
        subclasses); each becomes selectable by its ``name`` (config field ``attention_backend``)."""
        self._add_classes("attention_backends", backends)

    def logits_processors(self, *processors: type) -> None:
        """Declare logits processors (:class:`modelrunner.sampling.LogitsProcessor` subclasses); a
        request uses one by naming it in ``SamplingParams(logits_processors=[...])``."""
        self._add_classes("logits_processors", processors)

    def quantization_methods(self, *methods: type) -> None:
        """Declare weight quantization methods (:class:`modelrunner.quantization.QuantizationMethod`
        subclasses), selectable by ``name`` (config field ``quantization``)."""
        self._add_classes("quantization_methods", methods)

    def matmul_kernels(self, *kernels: type) -> None:
        """Declare matmul kernels for quantized weights (:class:`modelrunner.quantization.MatmulKernel`
        subclasses): each is timed against the others that claim a layer's weight format and device,
        and selectable by ``name`` (quantization option ``kernel``)."""
        self._add_classes("matmul_kernels", kernels)

    def grammar_backends(self, *backends: type) -> None:
        """Declare grammar backends for structured outputs (:class:`modelrunner.structured_output.GrammarBackend`
        subclasses), selectable by ``name`` (config ``structured_outputs_config={"backend": NAME}``); those
        with an ``auto_order`` take part in ``backend="auto"``."""
        self._add_classes("grammar_backends", backends)

    def tool_parsers(self, *parsers: type) -> None:
        """Declare tool-call parsers (:class:`modelrunner.tool_parser.ToolParser` subclasses), selectable
        by ``name`` (``modelrunner serve --enable-auto-tool-choice --tool-call-parser NAME``)."""
        self._add_classes("tool_parsers", parsers)

    def proposers(self, *proposers: type) -> None:
        """Declare speculative-decoding proposers (:class:`modelrunner.spec_decode.Proposer` subclasses),
        selectable by ``name`` (``speculative_config={"method": NAME, ...}``)."""
        self._add_classes("proposers", proposers)

    def lora_kernels(self, *kernels: type) -> None:
        """Declare batched LoRA kernels (:class:`modelrunner.lora.LoRAKernel` subclasses), selectable by
        ``name`` (config field ``lora_kernel``)."""
        self._add_classes("lora_kernels", kernels)

    def executors(self, *executors: type) -> None:
        """Declare executors (:class:`modelrunner.executor.Executor` subclasses: what runs a replica's
        ranks), selectable by ``name`` (config ``distributed_executor_backend``)."""
        self._add_classes("executors", executors)

    def pooling_methods(self, *methods: type) -> None:
        """Declare pooling methods for embeddings (:class:`modelrunner.pooling.PoolingMethod` subclasses),
        selectable by ``name`` (config field ``pooling_type``)."""
        self._add_classes("pooling_methods", methods)

    # -- looking up ----------------------------------------------------------------------------

    def names(self, kind: str) -> list[str]:
        """Sorted names of one kind."""
        return sorted(self.providers[kind])

    def by_plugin(self, plugin: str) -> dict[str, list[str]]:
        """kind → names provided by one plugin (kinds with none left out)."""
        out: dict[str, list[str]] = {}
        for kind, names in self.providers.items():
            mine = sorted(n for n, plugins in names.items() if plugin in plugins)
            if mine:
                out[kind] = mine
        return out

    def candidates(self, kind: str, name: str) -> list[str]:
        """The plugins that could serve ``name``: installed ones when any declared it, else the defaults."""
        plugins = self.providers[kind].get(name, [])
        installed = [p for p in plugins if p not in self.default_plugins]
        return installed or list(plugins)

    def conflicts(self) -> list[tuple[str, str, list[str]]]:
        """``(kind, name, plugins)`` for every name two or more installed plugins declared."""
        return [(kind, name, self.candidates(kind, name))
                for kind in KINDS for name in self.names(kind) if len(self.candidates(kind, name)) > 1]

    def owner(self, kind: str, name: str, choice: str | None = None, how_to_choose: str = "") -> str | None:
        """The plugin that serves ``name`` of ``kind``; None when nobody declared it.

        :param choice: the plugin the configuration picked (``adapter=`` / ``plugin:name``).
        :param how_to_choose: the config syntax that picks one, named in a conflict error.
        :raises PluginConflictError: several installed plugins declared it and ``choice`` picks none
            of them (the message lists them).
        """
        plugins = self.candidates(kind, name)
        if choice is not None:
            if choice in self.providers[kind].get(name, []):
                return choice
            what = kind.rstrip("s").replace("_", " ")
            raise PluginConflictError(
                f"plugin {choice!r} does not provide {what} {name!r}; it is provided by "
                f"{', '.join(repr(p) for p in plugins) or 'no loaded plugin'}")
        if not plugins:
            return None
        if len(plugins) > 1:
            what = kind.rstrip("s").replace("_", " ")
            raise PluginConflictError(
                f"{what} {name!r} is provided by several installed plugins ({', '.join(map(repr, plugins))}); "
                f"choose one{' with ' + how_to_choose if how_to_choose else ''} (install order never decides)")
        return plugins[0]

    def capabilities(self, kind: str, name: str, plugin: str) -> dict[str, Any]:
        """What ``plugin`` declared ``name`` of ``kind`` supports (None values: not declared)."""
        if kind in CLASS_CAPABILITIES:
            cls = self.classes[(kind, name, plugin)]
            return {key: getattr(cls, key, None) for key in CLASS_CAPABILITIES[kind]}
        return dict(self.declared.get((kind, name, plugin), CAPABILITIES[kind]))

    def get_class(self, kind: str, name: str, plugin: str) -> type:
        """The class ``plugin`` declared as ``name`` of a class kind."""
        return self.classes[(kind, name, plugin)]

    def unknown(self, kind: str, name: str, broken: dict[str, str] | None = None) -> str:
        """The message for a name nobody provides: the known ones, a suggestion, and broken plugins."""
        known = self.names(kind)
        what = kind.rstrip("s").replace("_", " ")
        hint = did_you_mean(name, known).replace("; did", ". Did")
        msg = f"unknown {what} {name!r}; installed: {', '.join(known) or '(none)'}{hint}"
        dist = PROJECT_NAMES.get(kind, {}).get(name)
        if dist is not None:
            msg += f" ({name!r} comes with the {dist} distribution: pip install {dist})"
        if broken:
            msg += " Plugins that failed to load and might provide it: " + "; ".join(
                f"{p}: {e}" for p, e in sorted(broken.items())
            )
        return msg
