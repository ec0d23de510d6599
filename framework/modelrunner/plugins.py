"""The plugin manager: entry points, the kernel's default plugins, allow/block lists, routing by name.

Every hook call for a name goes to the one plugin that registered it: ``load`` to the plugin that
registered the checkpoint's architecture, ``compile`` / ``allocate`` to the plugin that registered
the backend / allocator name, and ``forward`` / ``parallelize`` / ``process_inputs`` to the plugin
that loaded the model (:attr:`LoadedModel.adapter`). ``wrapper=True`` implementations of other
plugins still wrap the call, so tracers and profilers keep working.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
from importlib.metadata import entry_points
from typing import Any, Iterable

import attrs
import pluggy
import torch

from . import hookspecs
from .hookspecs import PLUGIN_API_VERSION
from .errors import ModelRunnerError, PluginError, UnknownNameError
from .plugin_timeout import IMPORT_TIMEOUT_ENV, PluginTimeoutError, call_bounded, import_timeout
from .registry import Registry, split_choice

ENTRY_POINT_GROUP = "modelrunner"
"""The entry-point group plugins declare themselves in."""

DEFAULT_PLUGINS: dict[str, str] = {
    "default-paged": "modelrunner.kv_cache.plugin",
    "default-transformers": "modelrunner.defaults.transformers_adapter",
    "default-eager": "modelrunner.defaults.eager",
    "default-sdpa": "modelrunner.defaults.attention",
    "default-sampling": "modelrunner.defaults.sampling",
    "default-quantization": "modelrunner.defaults.quantization",
    "default-executors": "modelrunner.defaults.executors",
    "default-pooling": "modelrunner.defaults.pooling",
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
    """Names it registered, by kind (architectures, allocators, compile_backends, ...)."""
    error: str | None = None
    """Why it failed to load, when it did."""
    api: str | None = None
    """The plugin API range it declares (``PLUGIN_API``), if any."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return attrs.asdict(self)


def failure_text(error: BaseException, doing: str) -> str:
    """How a plugin failed, for its ``error`` entry: ``"ImportError: ..."``; a ``sys.exit`` says so."""
    if isinstance(error, SystemExit):
        return f"SystemExit: {error.code} (the plugin called sys.exit while {doing})"
    if isinstance(error, PluginTimeoutError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class PluginAPIError(PluginError):
    """A plugin was built for a plugin API range this kernel is outside of."""


def api_range(plugin: Any) -> str | None:
    """The plugin API range a plugin module declares (``PLUGIN_API = ">=1.0,<2"``), or None."""
    value = getattr(plugin, "PLUGIN_API", None)
    if value is not None and not isinstance(value, str):
        raise PluginAPIError(f"PLUGIN_API must be a version specifier string like '>=1.0,<2', got {value!r}")
    return value


def check_api(spec: str | None) -> None:
    """Refuse a declared range that excludes this kernel's :data:`modelrunner.PLUGIN_API_VERSION`.

    :raises PluginAPIError: naming both versions (or the malformed range).
    """
    if spec is None:
        return
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    try:
        accepted = SpecifierSet(spec)
    except InvalidSpecifier as e:
        raise PluginAPIError(f"PLUGIN_API {spec!r} is not a version specifier (e.g. '>=1.0,<2'): {e}") from e
    if PLUGIN_API_VERSION not in accepted:
        raise PluginAPIError(f"built for plugin API {spec}, but this modelrunner provides plugin API "
                             f"{PLUGIN_API_VERSION}")


DEPRECATED_HOOK_ARGS: dict[str, dict[str, str]] = {
    "compile": {"model": "take `loaded` and wrap `loaded.runnable` (the eager callable) instead of `model`; "
                         "`model` goes in plugin API 2.0"},
}
"""hook → argument → migration, for hook arguments kept for one more minor version (the kernel
still passes them; implementations taking them warn once)."""
_warned: set[tuple[str, str, str]] = set()


def warn_deprecated_hooks(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """Warn once per (plugin, hook, argument) for implementations that take a deprecated argument."""
    import warnings

    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            for arg in impl.argnames:
                migration = DEPRECATED_HOOK_ARGS.get(caller.name, {}).get(arg)
                if migration is None or (name, caller.name, arg) in _warned:
                    continue
                _warned.add((name, caller.name, arg))
                warnings.warn(f"plugin {name!r}: the {caller.name} hook's argument {arg!r} is deprecated: {migration}",
                              DeprecationWarning, stacklevel=2)


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
    """A loaded plugin manager with its name registry, the report of what loaded, and routed calls.

    :param allow: entry-point names to load (None: all).
    :param block: plugin names (entry points or defaults) never to load.
    """

    def __init__(self, allow: Iterable[str] | None = None, block: Iterable[str] = ()) -> None:
        self.pm = _Manager()
        """The pluggy manager (for wrappers and diagnostics; call hooks through :meth:`call`)."""
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry(default_plugins=frozenset(DEFAULT_PLUGINS))
        """Every name the loaded plugins provide, by kind."""
        self.infos: dict[str, PluginInfo] = {}
        self.broken: dict[str, str] = {}
        """Plugin name → why it failed to load."""
        self._callers: dict[tuple[str, str], Any] = {}
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
        """The unrouted hook relay (every plugin's implementations); prefer :meth:`call`."""
        return self.pm.hook

    # -- loading ---------------------------------------------------------------------------------

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
        timeout = import_timeout()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in block or (allow is not None and ep.name not in allow):
                continue
            if self.pm.get_plugin(ep.name) is not None or ep.name in self.broken:
                continue  # the same entry point seen twice (e.g. duplicate metadata dirs)
            dist = ep.dist.name if ep.dist else "?"
            version = ep.dist.version if ep.dist else "?"
            api = None
            try:
                plugin = call_bounded(ep.load, f"importing plugin {ep.name!r}", timeout, IMPORT_TIMEOUT_ENV)
                api = api_range(plugin)
                check_api(api)
                self.pm.register(plugin, name=ep.name)
                warn_deprecated_hooks(self.pm, plugin, ep.name)
            except (Exception, SystemExit) as e:  # a broken plugin must not take the others down
                self.broken[ep.name] = failure_text(e, "importing it")
                self.infos[ep.name] = PluginInfo(ep.name, dist, version, error=self.broken[ep.name], api=api)
                continue
            self.infos[ep.name] = PluginInfo(ep.name, dist, version, api=api)

    def _collect_names(self) -> None:
        impls = self.pm.hook.register.get_hookimpls()
        for impl in reversed(impls):  # call order: installed plugins first, defaults last
            self.registry.current_plugin = impl.plugin_name
            try:
                impl.function(registry=self.registry)
            except (Exception, SystemExit) as e:
                self.broken[impl.plugin_name] = f"register hook raised {failure_text(e, 'registering its names')}"
        for name, info in list(self.infos.items()):
            plugin = self.pm.get_plugin(name)
            hooks = tuple(sorted(c.name for c in self.pm.get_hookcallers(plugin) or [])) if plugin else ()
            self.infos[name] = attrs.evolve(
                info, hooks=hooks, provides=self.registry.by_plugin(name), error=self.broken.get(name, info.error)
            )

    def list(self) -> list[PluginInfo]:
        """Every plugin seen, installed ones first, with its hooks, names and error."""
        return sorted(self.infos.values(), key=lambda i: (i.name in DEFAULT_PLUGINS, i.name))

    def problems(self) -> list[str]:
        """One line per broken plugin and per name several installed plugins claim (for ``--check``)."""
        lines = [f"plugin {name!r} is broken: {error}" for name, error in sorted(self.broken.items())]
        for kind, name, plugins in self.registry.conflicts():
            lines.append(f"{kind.rstrip('s').replace('_', ' ')} {name!r} is provided by several plugins: "
                         f"{', '.join(plugins)}")
        return lines

    # -- routing ---------------------------------------------------------------------------------

    def call(self, hook_name: str, plugin: str, **kwargs: Any) -> Any:
        """Call hook ``hook_name`` of ``plugin`` alone (other plugins' ``wrapper=True`` implementations
        still wrap it); None when the plugin does not implement that hook."""
        key = (hook_name, plugin)
        caller = self._callers.get(key)
        if caller is None:
            hook = getattr(self.pm.hook, hook_name)
            others = {impl.plugin for impl in hook.get_hookimpls()
                      if impl.plugin_name != plugin and not (impl.wrapper or impl.hookwrapper)}
            caller = self._callers[key] = self.pm.subset_hook_caller(hook_name, others)
        return caller(**kwargs)

    def implements(self, plugin: str, hook_name: str) -> bool:
        """Whether ``plugin`` has an implementation of ``hook_name``."""
        return any(impl.plugin_name == plugin for impl in getattr(self.pm.hook, hook_name).get_hookimpls())

    def require(self, kind: str, name: str, choice: str | None = None, how_to_choose: str = "") -> str:
        """The plugin serving ``name`` of ``kind`` (``"plugin:name"`` picks the plugin explicitly).

        :raises UnknownNameError: no loaded plugin provides it (the message lists those that do
            exist and the broken plugins).
        :raises PluginConflictError: several do and nothing picks one.
        """
        picked, bare = split_choice(name)
        owner = self.registry.owner(kind, bare, picked or choice,
                                    how_to_choose or f"'<plugin>:{bare}'")
        if owner is None:
            raise UnknownNameError(self.registry.unknown(kind, bare, self.broken))
        return owner

    def create_allocator(self, name: str, num_blocks: int, block_size: int, max_model_len: int, config: Any) -> Any:
        """The block allocator called ``name``, from the plugin that provides it."""
        owner = self.require("allocators", name)
        bare = split_choice(name)[1]
        allocator = self.call("allocate", owner, name=bare, num_blocks=num_blocks, block_size=block_size,
                              max_model_len=max_model_len, config=config)
        if allocator is None:
            raise PluginError(f"plugin {owner!r} registered allocator {bare!r} but its allocate hook returned None")
        return allocator

    def compile_model(self, name: str, loaded: Any, config: Any) -> Any:
        """The callable the compile backend ``name`` makes of ``loaded``."""
        owner = self.require("compile_backends", name)
        bare = split_choice(name)[1]
        fn = self.call("compile", owner, name=bare, loaded=loaded, config=config,
                       model=getattr(loaded, "runnable", None))
        if fn is None:
            raise PluginError(f"plugin {owner!r} registered compile backend {bare!r} but its compile hook "
                              "returned None")
        return fn

    def _class(self, kind: str, name: str) -> type:
        owner = self.require(kind, name)
        return self.registry.get_class(kind, split_choice(name)[1], owner)

    def attention_backend_class(self, name: str) -> type:
        """The :class:`~modelrunner.layers.AttentionBackend` subclass registered as ``name``."""
        return self._class("attention_backends", name)

    def attention_backends(self, device: torch.device | str | None = None) -> list[str]:
        """Names of the loaded attention backends; with ``device``, only those that support it."""
        names = self.registry.names("attention_backends")
        if device is None:
            return names
        device = torch.device(device)
        return [n for n in names if self.attention_backend_class(n).supports(device)]

    def attention_backend(self, device: torch.device | str, name: str | None = None) -> Any:
        """An instance of attention backend ``name``, or of the highest-priority one supporting ``device``.

        :raises UnknownNameError: ``name`` is unknown (the message lists the loaded ones).
        :raises ValueError: ``name`` does not support ``device``, or no loaded backend does.
        """
        device = torch.device(device)
        if name is not None:
            cls = self.attention_backend_class(name)
            if not cls.supports(device):
                usable = ", ".join(self.attention_backends(device)) or "(none)"
                raise ValueError(f"attention backend {name!r} does not support device {device}; backends that "
                                 f"do: {usable}")
            return cls()
        usable = [self.attention_backend_class(n) for n in self.attention_backends(device)]
        if not usable:
            raise ValueError(f"no loaded attention backend supports device {device} "
                             f"(loaded: {', '.join(self.registry.names('attention_backends')) or 'none'})")
        return max(usable, key=lambda cls: cls.priority)()

    def logits_processor_class(self, name: str) -> type:
        """The :class:`~modelrunner.sampling.LogitsProcessor` subclass registered as ``name``."""
        return self._class("logits_processors", name)

    def grammar_backend_class(self, name: str) -> type:
        """The :class:`~modelrunner.structured_output.GrammarBackend` subclass registered as ``name``."""
        return self._class("grammar_backends", name)

    def tool_parser_class(self, name: str) -> type:
        """The :class:`~modelrunner.tool_parser.ToolParser` subclass registered as ``name``."""
        return self._class("tool_parsers", name)

    def proposer_class(self, name: str) -> type:
        """The :class:`~modelrunner.spec_decode.Proposer` subclass registered as ``name``."""
        return self._class("proposers", name)
    def lora_kernel_class(self, name: str) -> type:
        """The :class:`~modelrunner.lora.LoRAKernel` subclass registered as ``name``."""
        return self._class("lora_kernels", name)
    def executor_class(self, name: str) -> type:
        """The :class:`~modelrunner.executor.Executor` subclass registered as ``name``."""
        return self._class("executors", name)

    def pooling_method_class(self, name: str) -> type:
        """The :class:`~modelrunner.pooling.PoolingMethod` subclass registered as ``name``."""
        return self._class("pooling_methods", name)

    def quantization_method_class(self, name: str) -> type:
        """The :class:`~modelrunner.quantization.QuantizationMethod` subclass registered as ``name``."""
        return self._class("quantization_methods", name)


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
    """The pluggy manager of :func:`get_plugins` (for code that inspects hooks directly)."""
    return get_plugins().pm


def get_registry() -> Registry:
    """The names every loaded plugin provides."""
    return get_plugins().registry


def create_allocator(name: str, num_blocks: int, block_size: int, max_model_len: int, config: Any) -> Any:
    """Create the KV-cache allocator ``name`` through the loaded plugins."""
    return get_plugins().create_allocator(name, num_blocks, block_size, max_model_len, config)


def feature_class(group: str, name: str, dist: str, feature: str, base: type | None = None) -> type:
    """The class a feature distribution declares under entry point ``name`` of ``group`` — how the kernel
    builds what it never imports by name (``data_parallel_size`` > 1's ``LLM``, ``enable_lora``'s manager,
    ``speculative_config``'s speculator).

    :param dist: the distribution of this project that provides it, named when none is installed.
    :param feature: what asked for it, for messages (``"enable_lora"``).
    :param base: a class the declared one must subclass (None: any class).
    :raises ModelRunnerError: no installed distribution declares it (saying what to install), or the one
        that does fails to import or names something that is not such a class.
    """
    found = sorted(entry_points(group=group, name=name), key=lambda ep: ep.value)
    if not found:
        raise ModelRunnerError(f"{feature} needs the {dist} distribution: pip install {dist}")
    ep = found[0]
    declarer = getattr(ep.dist, "name", None) or "its distribution"
    try:
        cls = ep.load()
    except Exception as e:  # noqa: BLE001 - named, with the error, instead of a bare traceback
        raise ModelRunnerError(f"{feature}: {declarer} declares {ep.value}, but it failed to import: "
                               f"{type(e).__name__}: {e}") from e
    if not isinstance(cls, type) or (base is not None and not issubclass(cls, base)):
        what = f"a subclass of {base.__name__}" if base is not None else "a class"
        raise ModelRunnerError(f"{feature}: {declarer} declares {ep.value}, which is not {what}")
    return cls
