"""The step channel: every rank gets each step, rank 0's answer comes back, and a rank that raises,
dies or hangs is named; only a connection presenting the rank's token is served."""

import pickle
import socket
import threading
import time

import pytest

from workers.step_channel import ChannelAddress, RankFailedError, StepClient, StepServer


def _servers(*executes):
    return [StepServer("127.0.0.1", execute) for execute in executes]


def test_every_rank_runs_each_step_and_rank_0s_answer_comes_back():
    seen: list[list[bytes]] = [[], []]

    def rank(i):
        def execute(payload):
            seen[i].append(bytes(payload))
            return bytes(payload[::-1]) if i == 0 else None

        return execute

    servers = _servers(rank(0), rank(1))
    client = StepClient([s.address for s in servers])
    try:
        big = bytes(range(256)) * 4096  # 1 MiB: larger than a socket buffer
        for payload in (b"step-1", b"", big):
            assert client.step(payload, timeout_s=10) == payload[::-1]
        assert seen[0] == seen[1] == [b"step-1", b"", big]
    finally:
        client.close()


def test_a_rank_that_raises_is_named_with_its_exception():
    def fails(payload):
        raise KeyError("nobody")

    servers = _servers(lambda p: b"ok", fails)
    client = StepClient([s.address for s in servers])
    with pytest.raises(RankFailedError) as info:
        client.step(b"x", timeout_s=10)
    assert info.value.rank == 1 and isinstance(info.value.cause, KeyError)
    client.close()


def test_a_rank_that_hangs_times_out_and_one_that_closes_is_a_connection_error():
    release = threading.Event()
    servers = _servers(lambda p: b"ok", lambda p: release.wait(30) and None)
    client = StepClient([s.address for s in servers])
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        client.step(b"x", timeout_s=0.5)
    assert info.value.rank == 1 and isinstance(info.value.cause, TimeoutError)
    assert time.monotonic() - t0 < 30  # the step timeout bounds the wait, not the hung rank
    release.set()
    client.close()


def test_a_rank_whose_process_dies_is_a_connection_error_naming_it():
    listener = socket.create_server(("127.0.0.1", 0))  # a rank that dies right after connecting
    port = listener.getsockname()[1]

    def die():
        conn, _ = listener.accept()
        conn.recv(16)
        conn.close()

    threading.Thread(target=die, daemon=True).start()
    live = _servers(lambda p: b"ok")[0]
    client = StepClient([live.address, ChannelAddress("127.0.0.1", port, b"t" * 16)])
    with pytest.raises(RankFailedError) as info:
        client.step(b"x", timeout_s=10)
    assert info.value.rank == 1 and isinstance(info.value.cause, ConnectionError)
    client.close()
    listener.close()


def test_a_connection_without_the_token_is_dropped_and_never_fed_to_the_rank():
    ran: list[bytes] = []
    server = StepServer("127.0.0.1", lambda p: ran.append(bytes(p)) or b"ran")
    intruder = socket.create_connection((server.address.host, server.address.port))
    intruder.sendall(b"\x00" * 16 + pickle.dumps("payload"))
    try:
        assert intruder.recv(1) == b""  # dropped: closed ...
    except ConnectionResetError:
        pass  # ... or reset, since it sent more than the server read
    intruder.close()
    client = StepClient([server.address])
    assert client.step(b"real", timeout_s=10) == b"ran"
    assert ran == [b"real"]
    client.close()
