"""Running a test function on several gloo ranks of one machine (``torch.multiprocessing.spawn``).

Each rank joins a file-rendezvous group, runs the function, waits for the others, leaves the group
and ends with ``os._exit``: gloo's threads can abort a normal interpreter teardown ("terminate called
without an active exception"), which would fail the test after its work succeeded.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch


def _rank(rank: int, world: int, init_file: str, fn: Callable[..., None], args: tuple) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        dist.barrier()  # every rank done before any tears gloo down
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable[..., None], world: int, init_file: str, *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks (``dist.group.WORLD`` joined); raise if any failed."""
    torch.multiprocessing.spawn(_rank, args=(world, init_file, fn, args), nprocs=world)
