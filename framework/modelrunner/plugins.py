"""The plugin manager: entry points, the kernel's default plugins, allowlist and blocklist, listing."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from typing import Any, Iterable

import attrs
import pluggy

from . import hookspecs
from .errors import PluginError, UnknownNameError
from .registry import Registry

ENTRY_POINT_GROUP = "modelrunner"
"""The entry-point group plugins declare themselves in."""

DEFAULT_PLUGINS: dict[str, str] = {
    "default-paged": "modelrunner.kv_cache.plugin",
    "default-transformers": "modelrunner.defaults.transformers_adapter",
    "default-eager": "modelrunner.defaults.eager",
    "default-sdpa": "modelrunner.defaults.attention",
}
"""The kernel's own plugins (name → module), registered ``trylast`` so installed plugins win."""

ALLOW_ENV = "MODELRUNNER_PLUGINS"
"""Comma list of entry-point names to load; unset loads all, empty loads none."""
BLOCK_ENV = "MODELRUNNER_BLOCK_PLUGINS"
"""Comma list of plugin names (entry points or defaults) never to load."""


@attrs.frozen
class PluginInfo:
    """One plugin as ``modelrunner plugins`` shows it."""

    name: str
    """Entry-point name (or ``default-*`` for the kernel's own)."""
    distribution: str
    """The installed distribution that declares it."""
    version: str
    """That distribution's version."""
    hooks: tuple[str, ...] = ()
    """Hooks it implements."""
    provides: dict[str, list[str]] = attrs.field(factory=dict)
    """Names it registered, by kind (architectures, allocators, compile_backends)."""
    error: str | None = None
    """Why it failed to load, when it did."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return attrs.asdict(self)


class _Manager(pluggy.PluginManager):
    """A PluginManager that registers the kernel's default plugins' hooks ``trylast``."""

    def __init__(self) -> None:
        super().__init__(ENTRY_POINT_GROUP)
        self.default_modules: set[int] = set()

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is not None and id(plugin) in self.default_modules:
            opts = {**opts, "trylast": True}
        return opts


class Plugins:
    """A loaded plugin manager with its name registry and the report of what loaded."""

    def __init__(self, allow: Iterable[str] | None = None, block: Iterable[str] = ()) -> None:
        self.pm = _Manager()
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.infos: dict[str, PluginInfo] = {}
        self.broken: dict[str, str] = {}
        allow_set = None if allow is None else set(allow)
        block_set = set(block)
        for name in block_set:
            self.pm.set_blocked(name)
        self._load_defaults(block_set)
        self._load_entry_points(allow_set, block_set)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            name = self.pm.get_name(e.plugin) or repr(e.plugin)
            raise PluginError(f"plugin {name!r} implements a hook that does not exist: {e}") from e
        self._collect_names()

    @property
    def hook(self) -> Any:
        """The hook relay (``plugins.hook.load(...)``)."""
        return self.pm.hook

    def _load_defaults(self, block: set[str]) -> None:
        version = importlib.metadata.version("modelrunner")
        for name, module_name in DEFAULT_PLUGINS.items():
            if name in block:
                continue
            module = importlib.import_module(module_name)
            self.pm.default_modules.add(id(module))
            self.pm.register(module, name=name)
            self.infos[name] = PluginInfo(name, "modelrunner", version)

    def _load_entry_points(self, allow: set[str] | None, block: set[str]) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            if self.pm.get_plugin(ep.name) is not None or ep.name in self.broken:
                continue  # the same entry point seen twice (e.g. duplicate metadata dirs)
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            try:
                plugin = ep.load()
                self.pm.register(plugin, name=ep.name)
            except Exception as e:  # a broken plugin must not take the others down
                self.broken[ep.name] = f"{type(e).__name__}: {e}"
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, error=self.broken[ep.name])
                continue
            self.infos[ep.name] = PluginInfo(ep.name, dist, version)

    def _collect_names(self) -> None:
        impls = self.pm.hook.register.get_hookimpls()
        for impl in reversed(impls):  # call order: installed plugins first, defaults last
            self.registry.current_plugin = impl.plugin_name
            try:
                impl.function(registry=self.registry)
            except Exception as e:
                self.broken[impl.plugin_name] = f"register hook raised {type(e).__name__}: {e}"
        for name, info in list(self.infos.items()):
            plugin = self.pm.get_plugin(name)
            hooks = tuple(sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])) if plugin else ()
            self.infos[name] = attrs.evolve(
                info, hooks=hooks, provides=self.registry.by_plugin(name), error=self.broken.get(name, info.error)
            )

    def list(self) -> list[PluginInfo]:
        """Every plugin seen, installed ones first, with its hooks, names and error."""
        return sorted(self.infos.values(), key=lambda i: (i.name in DEFAULT_PLUGINS, i.name))

    def require(self, kind: str, name: str) -> None:
        """Raise :class:`UnknownNameError` unless some loaded plugin registered ``name`` of ``kind``."""
        if name not in self.registry.provided[kind]:
            raise UnknownNameError(self.registry.unknown(kind, name, self.broken))

    def create_allocator(self, name: str, num_blocks: int, block_size: int, max_model_len: int, config: Any) -> Any:
        """The block allocator called ``name``, from whichever plugin provides it."""
        self.require("allocators", name)
        allocator = self.pm.hook.allocate(
            name=name, num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len, config=config
        )
        if allocator is None:
            raise PluginError(f"plugin {self.registry.provided['allocators'][name]!r} registered allocator "
                              f"{name!r} but its allocate hook returned None")
        return allocator

    def compile_model(self, name: str, loaded: Any, config: Any) -> Any:
        """The callable the compile backend ``name`` makes of ``loaded``."""
        self.require("compile_backends", name)
        fn = self.pm.hook.compile(name=name, loaded=loaded, config=config)
        if fn is None:
            raise PluginError(f"plugin {self.registry.provided['compile_backends'][name]!r} registered compile "
                              f"backend {name!r} but its compile hook returned None")
        return fn


def _env_list(var: str) -> list[str] | None:
    value = os.environ.get(var)
    if value is None:
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


_lock = threading.Lock()
_cached: dict[tuple, Plugins] = {}


def get_plugins(allow: Iterable[str] | None = None, block: Iterable[str] | None = None) -> Plugins:
    """The plugins for this process, loaded once per (allow, block) pair.

    With no arguments, ``$MODELRUNNER_PLUGINS`` and ``$MODELRUNNER_BLOCK_PLUGINS`` decide.
    """
    if allow is None:
        allow = _env_list(ALLOW_ENV)
    if block is None:
        block = _env_list(BLOCK_ENV) or []
    key = (None if allow is None else tuple(sorted(allow)), tuple(sorted(block)))
    with _lock:
        if key not in _cached:
            _cached[key] = Plugins(allow=allow, block=block)
        return _cached[key]


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager of :func:`get_plugins` (for code that calls hooks directly)."""
    return get_plugins().pm


def get_registry() -> Registry:
    """The names every loaded plugin provides."""
    return get_plugins().registry


def create_allocator(name: str, num_blocks: int, block_size: int, max_model_len: int, config: Any) -> Any:
    """Create the KV-cache allocator ``name`` through the loaded plugins."""
    return get_plugins().create_allocator(name, num_blocks, block_size, max_model_len, config)
