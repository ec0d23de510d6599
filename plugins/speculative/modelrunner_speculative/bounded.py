"""A proposer's calls, bounded: each runs in a thread of the proposer's own and is waited for at most
``$MODELRUNNER_PROPOSER_TIMEOUT`` seconds, so a proposer that blocks cannot hold the engine's step.

A call past the bound cannot be stopped (its thread is left behind, a daemon); the caller gets
:class:`ProposerTimeoutError` naming the proposer and the setting, and must not call the proposer
again (it may still be running). Calls carry the caller's grad/inference mode and CUDA device. What
a call raises reaches the caller as an ``Exception`` (a ``KeyboardInterrupt`` the proposer raised
itself becomes a ``RuntimeError``), so a real Ctrl-C while the caller waits is the only one it sees.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from modelrunner.api import PluginTimeoutError, timeout_from_env

PROPOSER_TIMEOUT_ENV = "MODELRUNNER_PROPOSER_TIMEOUT"
"""Seconds one call of a speculative-decoding proposer (``propose`` or ``forget``) may take (default
:data:`DEFAULT_PROPOSER_TIMEOUT_S`; ``0`` = no bound, calls run in the engine's thread). Past it,
speculative decoding is turned off for the engine's life and requests go on without drafts."""
DEFAULT_PROPOSER_TIMEOUT_S = 30.0
"""The proposer bound when ``$MODELRUNNER_PROPOSER_TIMEOUT`` is unset (a draft model's step on a slow
machine takes well under a second)."""

T = TypeVar("T")


class ProposerTimeoutError(PluginTimeoutError):
    """A proposer's call did not return within its bound (the message names the proposer and the setting)."""


def proposer_timeout() -> float | None:
    """The bound on one proposer call (``$MODELRUNNER_PROPOSER_TIMEOUT``; None: no bound).

    :raises ValueError: the value is not a number >= 0.
    """
    return timeout_from_env(PROPOSER_TIMEOUT_ENV, DEFAULT_PROPOSER_TIMEOUT_S)


class BoundedCalls:
    """Runs calls one at a time in a daemon thread, waiting for each at most ``timeout_s``.

    :param name: the proposer's name, for the thread and the error.
    :param timeout_s: the bound (None: calls run in the caller's thread, unbounded).
    """

    def __init__(self, name: str, timeout_s: float | None) -> None:
        self.name = name
        """Whose calls these are."""
        self.timeout_s = timeout_s
        """Seconds a call may take (None: no bound)."""
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future, tuple]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``'s result (or its exception), waiting at most :attr:`timeout_s`.

        :param what: the call, for the error (``"propose"``).
        :raises ProposerTimeoutError: ``fn`` did not return in time (it runs on in its thread).
        """
        if self.timeout_s is None:
            return fn()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=f"modelrunner-proposer {self.name}", daemon=True)
            self._thread.start()
        future: concurrent.futures.Future = concurrent.futures.Future()
        cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._jobs.put((fn, future, (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), cuda_device)))
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ProposerTimeoutError(f"proposer {self.name!r} did not return from {what} within {self.timeout_s:g} s "
                                       f"({PROPOSER_TIMEOUT_ENV}; 0 = no bound)") from None

    def _work(self) -> None:
        while True:
            fn, future, (grad, inference, cuda_device) = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if cuda_device is not None:
                    torch.cuda.set_device(cuda_device)
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    result = fn()
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt, GeneratorExit ... from the proposer
                # itself: no signal is delivered to this thread, so it must not reach the caller as one
                future.set_exception(RuntimeError(f"raised {type(exc).__name__}: {exc}"))
            else:
                future.set_result(result)
            del fn, future
