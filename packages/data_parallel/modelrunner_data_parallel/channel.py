"""An authenticated, framed connection between modelrunner processes (the data-parallel front and its
replicas) that carries ``modelrunner.wire`` messages.

Both ends prove they hold the same secret before anything else is read: the listener sends a random
challenge, the client answers with its HMAC-SHA256 under the secret and a challenge of its own, which
the listener answers in turn (so neither end talks to an impostor). The handshake has a deadline, so
a peer that connects and says nothing cannot hold the listener. Afterwards every message is one
frame: an 8-byte length, then ``wire.encode``'s bytes; a frame longer than ``max_frame`` bytes
closes the connection. What arrives is only ever decoded by ``wire.decode`` (data), on loopback
as beyond it: a listener and a client both refuse a secret shorter than :data:`MIN_SECRET_BYTES` (a
deployment on one machine makes a random one, :func:`check_secret`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from modelrunner import wire

HANDSHAKE_S = 10.0
"""How long a peer has to complete the handshake."""
MAX_FRAME = 1 << 30
"""The largest message accepted by default (bytes)."""
MAX_HANDSHAKES = 64
"""Handshakes under way at once; connections beyond them are closed at once."""
MIN_SECRET_BYTES = 16
"""The shortest secret accepted."""
_NONCE = 32
_HELLO = b"modelrunner-channel-1"


class ChannelError(ConnectionError):
    """The peer failed the handshake, sent a malformed or oversized frame, or went away."""


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or name) only reaches this machine."""
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_secret(secret: bytes, where: str) -> bytes:
    """``secret`` if long enough.

    :raises ValueError: shorter than :data:`MIN_SECRET_BYTES`, naming ``where`` it came from.
    """
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{where} must be at least {MIN_SECRET_BYTES} bytes long (got {len(secret)}); "
                         "generate one with: python -c 'import secrets; print(secrets.token_hex(32))'")
    return secret


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _HELLO + nonce, hashlib.sha256).digest()


class Channel:
    """One authenticated connection; :meth:`send` and :meth:`recv` move whole ``wire`` messages.

    :meth:`send` is safe from several threads; one thread receives. :func:`wait` (or
    :func:`select.select`, through ``fileno``) watches several.
    """

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        """Frames longer than this (bytes) close the connection."""
        self._send_lock = threading.Lock()
        self.closed = False

    def fileno(self) -> int:
        """The socket's descriptor."""
        return self.sock.fileno()

    def send(self, message: Any) -> None:
        """Encode and send ``message`` (blocks while the peer's buffers are full).

        :raises wire.WireError: ``message`` is not data (nothing was sent).
        :raises OSError: the connection is gone.
        """
        data = wire.encode(message)
        with self._send_lock:
            self.sock.sendall(struct.pack("!Q", len(data)) + data)

    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a message (or the end of the connection) can be read within ``timeout`` seconds."""
        if self.closed:
            raise OSError("the channel is closed")
        readable, _, _ = select.select([self.sock], [], [], timeout)
        return bool(readable)

    def recv(self) -> Any:
        """The next message (blocks until it arrives).

        :raises EOFError: the peer closed the connection.
        :raises ChannelError: an oversized or malformed frame (the connection is closed).
        """
        (size,) = struct.unpack("!Q", self._read(8))
        if size > self.max_frame:
            self.close()
            raise ChannelError(f"the peer sent a {size}-byte message; at most {self.max_frame} are accepted")
        try:
            return wire.decode(self._read(size))
        except wire.WireError as e:
            self.close()
            raise ChannelError(str(e)) from None

    def _read(self, size: int) -> bytes:
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = self.sock.recv_into(view[got:], min(size - got, 1 << 20))
            if n == 0:
                raise EOFError("the peer closed the connection")
            got += n
        return bytes(buf)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def __repr__(self) -> str:
        return f"<Channel fd={self.sock.fileno() if not self.closed else 'closed'}>"


def _exact(sock: socket.socket, size: int) -> bytes:
    buf = b""
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise ChannelError("the peer closed the connection during the handshake")
        buf += chunk
    return buf


def _handshake(sock: socket.socket, secret: bytes, server: bool) -> None:
    sock.settimeout(HANDSHAKE_S)
    try:
        if server:
            mine = os.urandom(_NONCE)
            sock.sendall(mine)
            answer = _exact(sock, 32 + _NONCE)
            if not hmac.compare_digest(answer[:32], _mac(secret, mine)):
                raise ChannelError("the peer does not hold this deployment's secret")
            sock.sendall(_mac(secret, answer[32:]))
        else:
            theirs = _exact(sock, _NONCE)
            mine = os.urandom(_NONCE)
            sock.sendall(_mac(secret, theirs) + mine)
            try:
                proof = _exact(sock, 32)
            except ChannelError:
                raise ChannelError("the listener closed the connection: it does not hold this deployment's "
                                   "secret (or refused this peer)") from None
            if not hmac.compare_digest(proof, _mac(secret, mine)):
                raise ChannelError("the listener does not hold this deployment's secret")
    except (socket.timeout, TimeoutError):
        raise ChannelError(f"the peer did not complete the handshake within {HANDSHAKE_S:g} s") from None
    sock.settimeout(None)


class ChannelListener:
    """Listens on ``(host, port)`` (port 0: a free one) for peers that hold ``secret``
    (:meth:`accept_in_background`)."""

    def __init__(self, address: tuple[str, int], secret: bytes, max_frame: int = MAX_FRAME) -> None:
        self.secret = check_secret(secret, "the channel's secret")
        self.max_frame = max_frame
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind(address)
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        """Where it listens (the real port when 0 was asked)."""
        self.closed = False

    def accept_in_background(self, on_channel: Callable[[Channel], None]) -> threading.Thread:
        """Accept peers on a thread of its own until :meth:`close`. Each peer does the handshake on a
        thread of its own (so one that connects and stays silent holds up nobody); one that holds the
        secret is handed to ``on_channel``, the others are dropped."""

        slots = threading.BoundedSemaphore(MAX_HANDSHAKES)

        def handshake(sock: socket.socket) -> None:
            try:
                _handshake(sock, self.secret, server=True)
            except (ChannelError, OSError):
                sock.close()
                return
            finally:
                slots.release()
            on_channel(Channel(sock, self.max_frame))

        def accept() -> None:
            while not self.closed:
                try:
                    sock, _ = self.sock.accept()
                except OSError:
                    return  # closed
                if not slots.acquire(blocking=False):
                    sock.close()  # a flood of silent peers: drop the newcomers, not the listener
                    continue
                threading.Thread(target=handshake, args=(sock,), name="modelrunner-channel-handshake",
                                 daemon=True).start()

        thread = threading.Thread(target=accept, name="modelrunner-channel-accept", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop listening."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def connect(address: tuple[str, int], secret: bytes, timeout: float = HANDSHAKE_S,
            max_frame: int = MAX_FRAME) -> Channel:
    """A channel to the listener at ``address``.

    :raises ChannelError: the listener does not hold ``secret``, or the handshake timed out.
    :raises ValueError: ``secret`` is shorter than :data:`MIN_SECRET_BYTES`.
    :raises OSError: nothing listens there.
    """
    check_secret(secret, "the channel's secret")
    sock = socket.create_connection(address, timeout=timeout)
    try:
        _handshake(sock, secret, server=False)
    except BaseException:
        sock.close()
        raise
    return Channel(sock, max_frame)


def wait(channels: list[Channel], timeout: float | None = None) -> list[Channel]:
    """The channels among ``channels`` with a message (or their end) to read, waiting up to ``timeout``
    seconds (None: until one has)."""
    readable, _, _ = select.select(channels, [], [], timeout)
    return readable


__all__ = ["Channel", "ChannelError", "ChannelListener", "check_secret", "connect", "is_loopback", "wait"]
