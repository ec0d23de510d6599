"""A sample plugin used by modelrunner's tests: the ``counting`` compile backend.

It runs the model eagerly and counts calls, so a test can prove the plugin was discovered through
its entry point and actually used.
"""

from __future__ import annotations

from typing import Any, Callable

from modelrunner import hookimpl

CALLS = {"compile": 0, "forward": 0}


@hookimpl
def register(registry: Any) -> None:
    registry.compile_backends("counting")


@hookimpl
def compile(name: str, loaded: Any) -> Callable[..., Any] | None:
    if name != "counting":
        return None
    CALLS["compile"] += 1
    model = loaded.model

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS["forward"] += 1
        return model(*args, **kwargs)

    return counted
