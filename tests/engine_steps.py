"""Stepping an engine to completion in tests (importable from every test folder, like gloo_ranks)."""

from __future__ import annotations

from typing import Any


def drain(engine: Any, max_steps: int = 500) -> dict:
    """Step ``engine`` until nothing is unfinished; request id → its final output.

    :raises AssertionError: requests still unfinished after ``max_steps`` steps (the engine is stuck).
    """
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"the engine is stuck: {engine.get_num_unfinished_requests()} requests never finish")
