"""The step channel with several steps in the ranks' hands (pipeline micro-batches): steps posted
before any is collected run on every rank in the order posted, their answers come back in that
order from the rank asked for (the sampling rank), and a rank that fails a posted step is named
when that step is collected."""

from __future__ import annotations

import threading

import pytest

from workers.step_channel import RankFailedError, StepClient, StepServer


def test_posted_steps_run_in_order_and_are_collected_in_order_from_the_sampling_rank():
    seen: list[list[bytes]] = [[], []]
    release = threading.Event()

    def rank(i: int):
        def execute(payload):
            if i == 1:
                release.wait(10)  # the last stage is still busy when every step is posted
            seen[i].append(bytes(payload))
            return b"sampled:" + bytes(payload) if i == 1 else None

        return execute

    servers = [StepServer("127.0.0.1", rank(i)) for i in range(2)]
    client = StepClient([s.address for s in servers])
    try:
        for payload in (b"k", b"k+1", b"k+2"):
            client.post(payload, timeout_s=10)
        release.set()
        answers = [bytes(client.collect(10, answer_rank=1)) for _ in range(3)]
        assert answers == [b"sampled:k", b"sampled:k+1", b"sampled:k+2"]
        assert seen[0] == seen[1] == [b"k", b"k+1", b"k+2"]
        # Rank 0's answers to the same steps are empty: it samples nothing.
        assert client.step(b"k+3", timeout_s=10, answer_rank=0) == b""
    finally:
        client.close()


def test_a_rank_that_fails_a_posted_step_is_named_when_that_step_is_collected():
    def fails_second(payload):
        if payload == b"2":
            raise ValueError("stage 1 broke on step 2")
        return b"ok"

    servers = [StepServer("127.0.0.1", lambda p: None), StepServer("127.0.0.1", fails_second)]
    client = StepClient([s.address for s in servers])
    try:
        for payload in (b"1", b"2"):
            client.post(payload, timeout_s=10)
        assert client.collect(10, answer_rank=1) == b"ok"
        with pytest.raises(RankFailedError) as info:
            client.collect(10, answer_rank=1)
        assert info.value.rank == 1 and isinstance(info.value.cause, ValueError)
    finally:
        client.close()


def test_collecting_a_step_no_rank_answers_times_out_naming_the_first_silent_rank():
    hold = threading.Event()
    servers = [StepServer("127.0.0.1", lambda p: hold.wait(30) and None) for _ in range(2)]
    client = StepClient([s.address for s in servers])
    try:
        client.post(b"x", timeout_s=10)
        with pytest.raises(RankFailedError) as info:
            client.collect(0.3, answer_rank=1)
        assert info.value.rank == 0 and isinstance(info.value.cause, TimeoutError)
    finally:
        hold.set()
        client.close()


def test_a_rank_whose_executor_leaves_with_steps_posted_stops_quietly():
    """An engine shut down with micro-batches in flight closes the channel while the rank still
    runs posted steps (and its worker is being shut down, so they fail): the answers have nowhere
    to go, and the rank's server thread ends without an exception, not with a traceback in the
    log of every replica that stops."""
    started, release = threading.Event(), threading.Event()

    def execute(payload):
        started.set()
        release.wait(10)
        raise RuntimeError("rank 1: load_model() must run first")

    server = StepServer("127.0.0.1", execute)
    client = StepClient([server.address])
    escaped: list[BaseException | None] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    try:
        for payload in (b"k", b"k+1", b"k+2"):
            client.post(payload, timeout_s=10)
        assert started.wait(10)
        client.close()
        release.set()
        server._thread.join(10)
        assert not server._thread.is_alive()
        assert escaped == []
    finally:
        threading.excepthook = hook
