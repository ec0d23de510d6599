"""What the front and a replica process agree on: the replica's orders, the heartbeat, the callable
methods, the secret, and how a tokenizer travels.

The messages themselves are listed in :mod:`.replica`; they travel over :mod:`modelrunner.channel`
as :mod:`modelrunner.wire` data (never pickles), after both ends proved they hold the deployment's
secret.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

import attrs

from modelrunner import ModelRunnerError
# The kernel's secret and address checks (internal: modelrunner.channel).
from modelrunner import wire  # kernel internal: the data codec, so a replica's orders are never a pickle
from .channel import check_secret, is_loopback

HEARTBEAT_S = 0.25
"""How often a replica sends its snapshot (the front's sign that it still answers)."""
CALLS = ("stats", "memory_stats", "reset_prefix_cache")
"""The LLM methods the front may call on a replica (without arguments)."""
ENGINE_CALLS = ("add_lora", "remove_lora")
"""The engine methods the front may call on a replica, with arguments: LoRA adapters are read by every
replica from the same path."""


@wire.register
@attrs.frozen
class ReplicaOrders:
    """What a replica process is told at start.

    :param config: the replica's configuration (``data_parallel_size`` 1: it is one engine).
    :param rank: its data-parallel rank (0 … ``data_parallel_size`` - 1).
    :param address: the front's listener ``(host, port)``.
    :param authkey: the deployment's secret (the listener's key).
    :param parent_pid: the process that started it; the replica dies with it.
    """

    config: Any
    rank: int
    address: tuple[str, int]
    authkey: bytes
    parent_pid: int


SECRET_ENV = "MODELRUNNER_DP_SECRET"
"""The deployment's secret when replicas join from other machines (the same on every machine)."""


def deployment_secret(address: str | None, remote_replicas: bool) -> bytes:
    """The secret the front and its replicas authenticate each other with.

    A deployment whose replicas all run on this machine gets a fresh random one. One whose replicas
    join from elsewhere (``--headless``, or a front that waits for them) needs :data:`SECRET_ENV`, the
    same on every machine: there is no default that an outsider could know.

    :param address: ``data_parallel_address`` (None: this machine only).
    :param remote_replicas: whether replicas started elsewhere must join.
    :raises ModelRunnerError: replicas join from elsewhere and :data:`SECRET_ENV` is unset.
    :raises ValueError: :data:`SECRET_ENV` is too short.
    """
    value = os.environ.get(SECRET_ENV, "")
    if value:
        return check_secret(value.encode(), SECRET_ENV)
    if not remote_replicas:
        return secrets.token_bytes(32)
    where = "on loopback" if is_loopback(address) else f"on {address}"
    raise ModelRunnerError(
        f"data-parallel replicas join this deployment from other processes {where}: set {SECRET_ENV} to the same "
        f"secret on every machine (front and --headless ones), at least 16 characters; for example "
        f"export {SECRET_ENV}={secrets.token_hex(32)}")


TOKENIZER_MAX_BYTES = 64 << 20
"""The most bytes of tokenizer files a replica may send (larger is refused)."""


def tokenizer_files(tokenizer: Any) -> dict[str, bytes] | None:
    """A tokenizer as the files ``save_pretrained`` writes (None for no tokenizer)."""
    if tokenizer is None:
        return None
    with tempfile.TemporaryDirectory(prefix="modelrunner-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes] | None) -> Any:
    """The tokenizer :func:`tokenizer_files` described.

    :raises ValueError: not a mapping of plain file names to bytes, or over :data:`TOKENIZER_MAX_BYTES`.
    """
    if files is None:
        return None
    if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, bytes) and k == Path(k).name and k not in ("", ".", "..")
            for k, v in files.items()):
        raise ValueError("a replica sent a malformed tokenizer (expected file names mapped to bytes)")
    if sum(len(v) for v in files.values()) > TOKENIZER_MAX_BYTES:
        raise ValueError(f"a replica sent more than {TOKENIZER_MAX_BYTES} bytes of tokenizer files")
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="modelrunner-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)
