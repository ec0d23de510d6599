"""The data-parallel RPC port (issue 52 item 1): a front waiting for replicas from elsewhere needs the
deployment's secret, and nothing it receives is ever unpickled — not from a stranger speaking
``multiprocessing.connection`` with the old public key, not even from a peer that holds the secret."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client

import pytest

from modelrunner import wire
from modelrunner_data_parallel import channel
from modelrunner_data_parallel.protocol import SECRET_ENV
from modelrunner.errors import ModelRunnerError

from .conftest import wait_for_no_children

CONFIG = dict(dtype="float32", compile=False, max_model_len=128)


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_front_that_waits_for_other_machines_refuses_to_start_without_a_secret(tiny_llama, monkeypatch):
    from modelrunner import LLM

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ModelRunnerError, match=rf"set {SECRET_ENV} .*export {SECRET_ENV}=[0-9a-f]{{64}}"):
        LLM(str(tiny_llama), data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=_free_port(), **CONFIG)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=rf"{SECRET_ENV} must be at least 16 bytes long \(got 5\)"):
        LLM(str(tiny_llama), data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
            data_parallel_rpc_port=_free_port(), **CONFIG)
    assert wait_for_no_children() == []  # refused before starting anything


def test_the_rpc_port_never_unpickles_what_arrives(tiny_llama, tmp_path, monkeypatch):
    from modelrunner import LLM

    secret = "s3cret-" + "x" * 24
    monkeypatch.setenv(SECRET_ENV, secret)
    monkeypatch.setenv("MODELRUNNER_DIST_TIMEOUT", "20")
    monkeypatch.setattr(channel, "HANDSHAKE_S", 1.0)
    port = _free_port()
    outcome: list[BaseException | object] = []

    def front() -> None:  # replica 0 here, replica 1 expected from elsewhere (it never comes)
        try:
            outcome.append(LLM(str(tiny_llama), data_parallel_size=2, data_parallel_size_local=1,
                               data_parallel_address="127.0.0.1", data_parallel_rpc_port=port, **CONFIG))
        except BaseException as e:  # noqa: BLE001
            outcome.append(e)

    thread = threading.Thread(target=front, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the front never listened"
            time.sleep(0.1)

    # A stranger with the key the old front accepted without MODELRUNNER_DP_SECRET, and a pickle.
    # multiprocessing's client reads the listener's random challenge as a length prefix, so how it gives
    # up depends on those bytes (a bad length, a wrong challenge, or the listener's deadline).
    stranger = tmp_path / "stranger-ran-code"
    with pytest.raises((EOFError, OSError, ConnectionError, AssertionError)):
        conn = Client(("127.0.0.1", port), authkey=b"modelrunner-data-parallel")
        conn.send(_Payload(str(stranger)))
        conn.recv()
    # The same pickle pushed straight at the port, framed as multiprocessing frames it: the listener
    # takes its first bytes as a handshake answer, finds them wrong and hangs up.
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    blob = pickle.dumps(_Payload(str(stranger)))
    raw.sendall(struct.pack("!i", len(blob)) + blob)
    try:
        while raw.recv(1 << 16):
            pass
    except ConnectionResetError:  # closed with our bytes unread
        pass
    raw.close()
    # Someone who knows the secret but sends a pickle instead of data: the connection is dropped.
    insider = tmp_path / "insider-ran-code"
    peer = channel.connect(("127.0.0.1", port), secret.encode())
    blob = pickle.dumps(("hello", 1, _Payload(str(insider))))
    peer.sock.sendall(struct.pack("!Q", len(blob)) + blob)
    peer.sock.settimeout(10)
    assert peer.sock.recv(1) == b""  # closed by the front
    peer.close()
    # A wrong secret fails the handshake.
    with pytest.raises(channel.ChannelError, match="does not hold this deployment's secret"):
        channel.connect(("127.0.0.1", port), b"not-the-secret-at-all-0123456789")
    # A peer that connects and says nothing holds up nobody (the handshake has a deadline).
    silent = socket.create_connection(("127.0.0.1", port))
    thread.join(40)
    silent.close()
    assert not stranger.exists() and not insider.exists()
    assert len(outcome) == 1 and isinstance(outcome[0], ModelRunnerError), outcome
    assert "replica(s) [1] did not join" in str(outcome[0])
    assert wait_for_no_children() == []


def test_the_channel_itself_requires_a_full_secret_on_loopback_too_and_carries_only_data():
    # Not only the data-parallel front: the channel refuses to listen or connect with an empty or short
    # secret, whatever the address; between two holders of one secret it carries wire data, and what
    # is not data is refused before anything is sent.
    for short in (b"", b"loopback-15byte"):
        with pytest.raises(ValueError, match=r"the channel's secret must be at least 16 bytes long"):
            channel.ChannelListener(("127.0.0.1", 0), short)
        with pytest.raises(ValueError, match=r"the channel's secret must be at least 16 bytes long"):
            channel.connect(("127.0.0.1", 1), short)
    secret = os.urandom(32)
    listener = channel.ChannelListener(("127.0.0.1", 0), secret)
    accepted: list[channel.Channel] = []
    listener.accept_in_background(accepted.append)
    try:
        client = channel.connect(listener.address, secret)
        client.send(("hello", 1, {"ids": [1, 2]}))
        deadline = time.monotonic() + 10
        while not accepted:
            assert time.monotonic() < deadline, "the listener never handed the channel over"
            time.sleep(0.01)
        (server,) = accepted
        assert channel.wait([server], timeout=10) == [server]
        assert server.recv() == ("hello", 1, {"ids": [1, 2]})
        assert channel.wait([server], timeout=0) == []
        with pytest.raises(wire.WireError):
            client.send(_Payload("never-sent"))
        client.close()
        server.close()
    finally:
        listener.close()


def test_wire_refuses_what_it_cannot_send_and_unregistered_types():
    from modelrunner import SamplingParams, wire

    with pytest.raises(wire.WireError, match="function or other callable"):
        wire.encode(SamplingParams(logits_processors=[lambda ids, row: row]))
    with pytest.raises(wire.WireError, match="not registered for the wire"):
        wire.decode(b"\xc7" + bytes([len(b := wire._pack(["os.system", {"command": "true"}]))]) + b"\x03" + b)
    params = SamplingParams(max_tokens=3, temperature=0, stop=["x"], logit_bias={5: 1.0},
                            structured_outputs={"regex": "[ab]+"})
    assert wire.decode(wire.encode(params)) == params


@pytest.mark.parametrize("module", ["modelrunner_executor_mp.worker", "modelrunner_data_parallel.replica"])
def test_a_started_child_reads_its_orders_as_data_and_refuses_a_pickle(module, tmp_path):
    """A worker or replica reads its orders from the parent's pipe as wire data: a pickle there is refused
    before anything in it runs."""
    ran = tmp_path / "child-ran-code"
    proc = subprocess.run([sys.executable, "-m", module], input=pickle.dumps(_Payload(str(ran))),
                          capture_output=True, timeout=60)
    assert proc.returncode != 0 and not ran.exists()
    assert b"WireError" in proc.stderr, proc.stderr.decode()[-2000:]
