"""The names plugins provide (architectures, allocators, compile backends, attention backends), and who
provides them."""

from __future__ import annotations

import difflib

import attrs

KINDS = ("architectures", "allocators", "compile_backends", "attention_backends")


@attrs.define
class Registry:
    """Collects names through the ``register`` hook, remembering the plugin behind each."""

    provided: dict[str, dict[str, str]] = attrs.field(factory=lambda: {k: {} for k in KINDS})
    """kind → name → plugin that provides it."""
    current_plugin: str = "?"
    """The plugin whose ``register`` hook is running (set by the plugin manager)."""

    def _add(self, kind: str, names: tuple[str, ...]) -> None:
        for name in names:
            if not isinstance(name, str) or not name:
                raise ValueError(f"plugin {self.current_plugin!r} registered an invalid {kind} name {name!r}")
            # First registration wins: plugins register in hook order, installed before defaults.
            self.provided[kind].setdefault(name, self.current_plugin)

    def architectures(self, *names: str) -> None:
        """Declare model architectures (HF ``architectures`` entries) the plugin's load hook accepts."""
        self._add("architectures", names)

    def allocators(self, *names: str) -> None:
        """Declare KV-cache allocator names the plugin's allocate hook answers."""
        self._add("allocators", names)

    def compile_backends(self, *names: str) -> None:
        """Declare compile backend names the plugin's compile hook answers."""
        self._add("compile_backends", names)

    def attention_backends(self, *backends: type) -> None:
        """Declare paged-attention implementations (:class:`modelrunner.layers.AttentionBackend`
        subclasses); each becomes selectable by its ``name`` (config field ``attention_backend``)."""
        from .layers.attention import AttentionBackend, register_attention_backend

        for cls in backends:
            if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
                raise ValueError(f"plugin {self.current_plugin!r} registered {cls!r} as an attention backend; "
                                 "expected an AttentionBackend subclass")
            register_attention_backend(cls)
        self._add("attention_backends", tuple(cls.name for cls in backends))

    def names(self, kind: str) -> list[str]:
        """Sorted names of one kind."""
        return sorted(self.provided[kind])

    def by_plugin(self, plugin: str) -> dict[str, list[str]]:
        """kind → names provided by one plugin (kinds with none left out)."""
        out: dict[str, list[str]] = {}
        for kind, names in self.provided.items():
            mine = sorted(n for n, p in names.items() if p == plugin)
            if mine:
                out[kind] = mine
        return out

    def unknown(self, kind: str, name: str, broken: dict[str, str] | None = None) -> str:
        """The message for a name nobody provides: the known ones, a suggestion, and broken plugins."""
        known = self.names(kind)
        what = kind.rstrip("s").replace("_", " ")
        msg = f"unknown {what} {name!r}; installed: {', '.join(known) or '(none)'}"
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
        if broken:
            msg += " Plugins that failed to load and might provide it: " + "; ".join(
                f"{p}: {e}" for p, e in sorted(broken.items())
            )
        return msg
