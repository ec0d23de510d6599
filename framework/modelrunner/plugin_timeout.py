"""Bounds on plugin code the kernel waits for: importing a plugin and its ``load`` hook.

A plugin that hangs (a network call at import, a deadlock in ``load``) would otherwise hang the
process that loads it without a word. The call runs in a helper thread and the caller waits at most
the bound; when it fires, :class:`PluginTimeoutError` names the plugin and the setting. The helper
thread cannot be stopped and is left behind (a daemon thread: it does not keep the process alive).
It runs with the caller's context variables, grad/inference mode and CUDA device.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .errors import PluginError

IMPORT_TIMEOUT_ENV = "MODELRUNNER_PLUGIN_TIMEOUT"
"""Seconds importing one plugin may take (default :data:`DEFAULT_IMPORT_TIMEOUT_S`; ``0`` = no
bound). A plugin past it is reported broken, like one whose import raised, and the others load."""
DEFAULT_IMPORT_TIMEOUT_S = 120.0
"""The import bound when ``$MODELRUNNER_PLUGIN_TIMEOUT`` is unset."""
LOAD_TIMEOUT_ENV = "MODELRUNNER_LOAD_TIMEOUT"
"""Seconds a plugin's ``load`` hook (building the model and reading its weights) may take (default
:data:`DEFAULT_LOAD_TIMEOUT_S`; ``0`` = no bound). Past it, loading fails naming the plugin."""
DEFAULT_LOAD_TIMEOUT_S = 1800.0
"""The ``load`` bound when ``$MODELRUNNER_LOAD_TIMEOUT`` is unset (reading a large checkpoint from a
slow disk legitimately takes minutes)."""

T = TypeVar("T")
_inside = threading.local()


class PluginTimeoutError(PluginError):
    """A plugin's import or hook did not finish within its bound (the message names the plugin and the setting)."""


def timeout_from_env(var: str, default: float) -> float | None:
    """Seconds from ``$var`` (``default`` when unset; None when ``0``: no bound).

    :raises ValueError: the value is not a number ≥ 0.
    """
    raw = os.environ.get(var, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"{var} must be a number of seconds >= 0 (0 = no bound), got {raw!r}")
    return value or None


def import_timeout() -> float | None:
    """The bound on importing one plugin (``$MODELRUNNER_PLUGIN_TIMEOUT``)."""
    return timeout_from_env(IMPORT_TIMEOUT_ENV, DEFAULT_IMPORT_TIMEOUT_S)


def load_timeout() -> float | None:
    """The bound on one ``load`` hook (``$MODELRUNNER_LOAD_TIMEOUT``)."""
    return timeout_from_env(LOAD_TIMEOUT_ENV, DEFAULT_LOAD_TIMEOUT_S)


def call_bounded(fn: Callable[[], T], what: str, timeout_s: float | None, setting: str) -> T:
    """``fn()``'s result (or its exception, ``SystemExit`` included), waiting at most ``timeout_s``.

    Calls made inside another bounded call run directly: the outer bound covers them.

    :param what: what is running, for the error (``"importing plugin 'x'"``).
    :param setting: the environment variable that sets the bound, for the error.
    :raises PluginTimeoutError: ``fn`` did not finish in time.
    """
    if timeout_s is None or getattr(_inside, "active", False):
        return fn()
    outcome: dict[str, Any] = {}
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    context = contextvars.copy_context()

    def run() -> None:
        _inside.active = True
        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                outcome["result"] = context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=f"modelrunner-bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise PluginTimeoutError(f"{what} did not finish within {timeout_s:g} s ({setting}; 0 = no bound)")
    if "error" in outcome:
        error = outcome.pop("error")
        try:
            raise error
        finally:
            del error
    return outcome["result"]
