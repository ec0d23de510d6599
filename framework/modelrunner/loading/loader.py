"""Loading a checkpoint through the plugin that registered its architecture, and parallelizing it
through the plugin that loaded it: the routing the runner uses, handed to load hooks as ``loader``
so a composite model (e.g. LLaVA) loads its parts the same way."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ..errors import PluginError, PluginWarning, UnknownNameError
from ..loaded_model import LoadedModel
from ..plugin_timeout import LOAD_TIMEOUT_ENV, call_bounded, load_timeout
from ..registry import FALLBACK_ARCHITECTURE
from .weights import unset_buffers, unset_buffers_message


class ModelLoader:
    """Routes ``load`` and ``parallelize`` for one runner: same device, dtype, ranks, attention backend.

    :param plugins: the :class:`~modelrunner.plugins.Plugins` that route the calls.
    :param config: the whole :class:`~modelrunner.config.RunnerConfig`.
    :param device: where weights go; ``dtype`` their floating-point type.
    :param parallel: this process's ranks.
    :param attention_backend: the backend instance every attention layer of the model uses.
    :param max_model_len: the longest sequence the runner serves (resolved; never None).
    """

    def __init__(self, plugins: Any, config: Any, device: torch.device, dtype: torch.dtype, parallel: Any,
                 attention_backend: Any, max_model_len: int) -> None:
        self.plugins = plugins
        self.config = config
        """The runner configuration passed to every hook."""
        self.device = device
        """Where weights go."""
        self.dtype = dtype
        """Floating-point type of weights and activations."""
        self.parallel = parallel
        """This process's tensor/pipeline ranks."""
        self.attention_backend = attention_backend
        """The attention backend instance the model's layers use."""
        self.max_model_len = max_model_len
        """The longest sequence (prompt + output) the runner serves."""

    def adapter_for(self, source: Any, adapter: str | None = None) -> str:
        """The plugin whose load hook builds ``source`` (see :func:`adapter_for`)."""
        return adapter_for(self.plugins, source, adapter)

    def load(self, source: Any, adapter: str | None = None) -> LoadedModel:
        """Build and load ``source`` with this runner's settings; ``LoadedModel.adapter`` names the plugin.

        :raises UnknownNameError: no plugin loads the checkpoint.
        :raises PluginError: the plugin that registered the architecture returned nothing (or exited), or
            its model has buffers that :func:`~modelrunner.loading.weights.materialize` allocated and nothing set
            (named, with what to do).
        :raises PluginTimeoutError: its load hook ran past ``$MODELRUNNER_LOAD_TIMEOUT``.
        """
        owner = self.adapter_for(source, adapter)
        try:
            loaded = call_bounded(lambda: self.plugins.call(
                "load", owner, source=source, config=self.config, device=self.device, dtype=self.dtype,
                parallel=self.parallel, attention_backend=self.attention_backend, max_model_len=self.max_model_len,
                loader=self), f"plugin {owner!r}'s load hook", load_timeout(), LOAD_TIMEOUT_ENV)
        except SystemExit as e:
            raise PluginError(f"plugin {owner!r}'s load hook called sys.exit({e.code!r})") from e
        if loaded is None:
            if source.architecture not in self.plugins.registry.providers["architectures"]:
                raise UnknownNameError(self.plugins.registry.unknown(
                    "architectures", source.architecture or f"model_type={source.hf_config.model_type}",
                    self.plugins.broken))
            raise PluginError(f"plugin {owner!r} registered architecture {source.architecture!r} but its load "
                              "hook returned None")
        if not isinstance(loaded, LoadedModel):
            raise PluginError(f"plugin {owner!r}'s load hook returned {type(loaded).__name__}, not a LoadedModel")
        unset = unset_buffers(loaded.model)
        if unset:
            raise PluginError(unset_buffers_message(loaded.model, unset, f"adapter {owner!r}"))
        loaded.adapter = owner
        return loaded

    def parallelize(self, loaded: LoadedModel) -> LoadedModel:
        """Apply the parallel plan of each part (``loaded.parts``), then of the model, through the
        plugin that loaded each.

        :raises ValueError: the world size is above 1 and the adapter has no parallelize hook.
        """
        for name, part in list(loaded.parts.items()):
            loaded.parts[name] = self.parallelize(part)
        if not self.plugins.implements(loaded.adapter, "parallelize"):
            if self.parallel.world_size > 1:
                raise ValueError(f"adapter {loaded.adapter!r} implements no parallelize hook, so it cannot run "
                                 f"across {self.parallel.world_size} processes; use tensor_parallel_size=1 and "
                                 "pipeline_parallel_size=1")
            return loaded
        result = self.plugins.call("parallelize", loaded.adapter, loaded=loaded, parallel=self.parallel, loader=self)
        if result is None:
            return loaded
        result.adapter = loaded.adapter
        return result


def adapter_for(plugins: Any, source: Any, adapter: str | None = None) -> str:
    """The plugin whose load hook builds ``source``: the one that registered its architecture
    (``adapter`` picks one when several did), else a generic fallback adapter.

    :raises UnknownNameError: nobody registered the architecture and no fallback is loaded.
    :raises PluginConflictError: several installed plugins registered it and ``adapter`` is unset.
    """
    registry, broken = plugins.registry, plugins.broken
    arch = source.architecture
    owner = registry.owner("architectures", arch, adapter, how_to_choose="adapter=<plugin>") if arch else None
    if owner is not None:
        return owner
    fallback = registry.owner("architectures", FALLBACK_ARCHITECTURE)
    if fallback is None:
        raise UnknownNameError(registry.unknown("architectures", arch or "(none in config.json)", broken))
    if broken:
        failures = "; ".join(f"{name}: {error}" for name, error in sorted(broken.items()))
        warnings.warn(f"no loaded plugin registers architecture {arch!r}, so the slow generic adapter "
                      f"{fallback!r} runs it; plugins that failed to load: {failures}", PluginWarning,
                      stacklevel=3)
    return fallback
