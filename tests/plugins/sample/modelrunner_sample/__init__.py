"""A sample plugin used by modelrunner's tests: the ``counting`` compile backend.

It wraps the kernel's eager backend (keeping its prepacked weights) and counts calls, so a test can
prove the plugin was discovered through its entry point and actually used.
"""

from __future__ import annotations

from typing import Any, Callable

from modelrunner import hookimpl
from modelrunner.defaults.eager import eager_model

CALLS = {"compile": 0, "forward": 0}


@hookimpl
def register(registry: Any) -> None:
    registry.compile_backends("counting")


@hookimpl
def compile(loaded: Any, config: Any) -> Callable[..., Any]:
    CALLS["compile"] += 1
    run = eager_model(loaded, config.options)

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS["forward"] += 1
        return run(*args, **kwargs)

    return counted
