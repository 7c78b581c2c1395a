"""KV payloads pulled over real torch.distributed pairs (gloo, loopback; both ends in this process,
on threads of their own): what is pulled is what was sent, an outbox frees each payload after its
readers, after a release, after hold_s or past max_bytes, a sender that never answers costs a
bounded wait, a receiver on another machine takes the fallback's copy, and NCCL is picked for CUDA
tensors and refused where there is none. Cross-process pulls: tests/cluster/test_disagg_tp.py."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from workers import kv_collective, kv_pairs
from workers.kv_collective import CollectiveTransport
from workers.kv_pairs import (
    CollectiveRef,
    KVServer,
    Puller,
    machine_id,
    pair_group,
    wire_backend,
)
from workers.kv_transfer import InProcessTransport, KVPayload, TransferHandle

HOST = "127.0.0.1"


def payload(rows: int = 3, width: int = 96, rank: int = 0) -> KVPayload:
    data = np.arange(rows * width, dtype=np.uint32).astype(np.uint8).reshape(rows, width)
    return KVPayload([2**127 + i for i in range(rows)], [7 * i for i in range(rows)], "float32",
                     (1, 2, 2, 2, 3), data, rank)  # fmt: skip


def meta_of(p: KVPayload) -> dict:
    return kv_collective._meta(p)


@pytest.fixture(scope="module")
def puller() -> Iterator[Puller]:
    pulls = Puller()
    yield pulls
    pulls.close(timeout_s=5.0)  # BYE on each pair: its server's thread leaves its wait


def test_a_server_stops_its_threads_once_its_receivers_say_bye():
    # A thread still inside a torch.distributed wait at interpreter exit aborts the process.
    server, pulls = KVServer(HOST, hold_s=60.0, max_bytes=1 << 20), Puller()
    ref = server.offer("f" * 32, {}, torch.zeros(8, dtype=torch.uint8))
    assert pulls.pull(ref, readers=1, timeout_s=30.0, max_bytes=1 << 20) is not None
    assert [t.name for t in server.threads] == ["kv-collective", "kv-pair-1"]
    pulls.close(timeout_s=5.0)
    assert server.stop(timeout_s=30.0)
    assert not any(thread.is_alive() for thread in server.threads)
    assert server in kv_pairs._started and pulls in kv_pairs._pulling  # at exit too


def test_a_pull_brings_the_payload_byte_for_byte_then_it_is_gone(puller):
    server = KVServer(HOST, hold_s=60.0, max_bytes=1 << 20)
    sent = payload(rank=1)
    ref = server.offer("a" * 32, meta_of(sent), torch.from_numpy(sent.data))
    got = puller.pull(ref, readers=1, timeout_s=30.0, max_bytes=1 << 20)
    assert got is not None
    received = kv_collective._payload(json.loads(ref.meta), sent.hashes, got)
    assert ref.nbytes == sent.nbytes and received.crcs == sent.crcs
    assert received.rank == 1 and received.block_shape == sent.block_shape
    assert np.array_equal(received.data, sent.data)
    assert puller.pull(ref, 1, 30.0, 1 << 20) is None  # one reader: freed on its pull
    assert server.held_bytes() == 0 and server.num_pairs == 1  # the pair was kept and reused


def test_a_payload_for_two_readers_is_freed_after_the_second(puller):
    server = KVServer(HOST, hold_s=60.0, max_bytes=1 << 20)
    sent = payload()
    ref = server.offer("b" * 32, meta_of(sent), torch.from_numpy(sent.data))
    assert puller.pull(ref, 2, 30.0, 1 << 20) is not None
    assert server.held_bytes() == sent.nbytes
    assert puller.pull(ref, 2, 30.0, 1 << 20) is not None
    assert server.held_bytes() == 0


def test_a_release_without_a_pull_frees_it(puller):
    server = KVServer(HOST, hold_s=60.0, max_bytes=1 << 20)
    sent = payload()
    ref = server.offer("c" * 32, meta_of(sent), torch.from_numpy(sent.data))
    puller.done(ref, 1, 30.0)
    assert puller.pull(ref, 1, 30.0, 1 << 20) is None  # the pair serves requests in order
    assert server.held_bytes() == 0


def test_the_outbox_drops_what_outlives_hold_s_and_the_oldest_past_max_bytes(puller):
    brief = KVServer(HOST, hold_s=1e-3, max_bytes=1 << 20)
    sent = payload()
    ref = brief.offer("d" * 32, meta_of(sent), torch.from_numpy(sent.data))
    assert puller.pull(ref, 1, 30.0, 1 << 20) is None and brief.held_bytes() == 0
    small = KVServer(HOST, hold_s=60.0, max_bytes=sent.nbytes * 3 // 2)
    first = small.offer("e" * 32, meta_of(sent), torch.from_numpy(sent.data))
    second = small.offer("f" * 32, meta_of(sent), torch.from_numpy(sent.data))
    assert small.held_bytes() == sent.nbytes
    assert puller.pull(first, 1, 30.0, 1 << 20) is None
    assert puller.pull(second, 1, 30.0, 1 << 20) is not None
    with pytest.raises(ValueError, match="max_bytes"):
        small.offer("0" * 32, meta_of(payload(rows=8)), torch.from_numpy(payload(rows=8).data))


def test_a_payload_larger_than_the_receiver_allows_is_not_pulled(puller):
    server = KVServer(HOST, hold_s=60.0, max_bytes=1 << 20)
    sent = payload()
    ref = server.offer("9" * 32, meta_of(sent), torch.from_numpy(sent.data))
    with pytest.raises(ValueError, match="out of bounds"):
        puller.pull(ref, 1, 30.0, max_bytes=sent.nbytes - 1)


def test_a_transport_round_trip_and_a_sender_that_never_answers():
    transport = CollectiveTransport()
    sent = payload()
    handle = transport.send(sent)
    assert isinstance(handle.ref[0], CollectiveRef) and handle.ref[0].backend == "gloo"
    received = transport.receive(handle, 30.0)
    assert received is not None and np.array_equal(received.data, sent.data)
    transport.release(handle)
    assert handle.ref == []
    # Nobody serves pulls at this store: forming the pair times out, the transfer is missing.
    silent = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    ref = CollectiveRef(HOST, silent.port, machine_id(), "gloo", "1" * 32, 8, "{}")
    assert transport.receive(TransferHandle("1" * 32, [1], [ref]), timeout_s=0.5) is None
    transport.release(TransferHandle("1" * 32, [1], [ref]))  # tried: nothing more is sent
    kv_pairs.releases_sent()


def test_another_machine_takes_the_fallback_s_copy():
    fallback = InProcessTransport()
    transport = CollectiveTransport(fallback, copy_to_fallback=True)
    sent = payload()
    handle = transport.send(sent)
    here = handle.ref[0]
    assert isinstance(here, CollectiveRef) and here.fallback_copy
    assert set(fallback.payloads) == {handle.key}  # the copy, under the handle's key
    elsewhere = replace(here, machine="another/machine")  # loopback there is not our loopback
    moved = TransferHandle(handle.key, handle.hashes, [elsewhere])
    received = transport.receive(moved, 5.0)
    assert received is sent  # no pull was tried: the fallback's copy came
    transport.release(moved)
    transport.release(handle)
    kv_pairs.releases_sent()
    assert fallback.payloads == {} and handle.ref == []


def test_a_sender_whose_server_cannot_start_sends_through_the_fallback():
    fallback = InProcessTransport()
    transport = CollectiveTransport(fallback, host="192.0.2.1")  # not this machine's address
    handle = transport.send(payload())
    assert not any(isinstance(r, CollectiveRef) for r in handle.ref)
    with pytest.raises(OSError):
        CollectiveTransport(host="192.0.2.1").send(payload())


def test_cuda_tensors_pick_nccl_which_a_cpu_process_refuses_by_name():
    assert wire_backend(torch.device("cuda", 0)) == "nccl"
    assert wire_backend(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="device"):
        wire_backend(torch.device("meta"))
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA: the refusal is for processes without it")
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
    with pytest.raises(ValueError, match="NCCL"):
        pair_group(store, 0, "nccl", HOST, 1.0)
    ref = CollectiveRef(HOST, store.port, machine_id(), "nccl", "2" * 32, 8, "{}")
    assert CollectiveTransport().receive(TransferHandle("k", [1], [ref]), 1.0) is None


@pytest.mark.parametrize("bad", [2**64, -1, math.nan, math.inf, 10**30, True, "1"])
@pytest.mark.parametrize("name", ["hold_s", "max_bytes"])
def test_bounds_are_a_value_error_naming_the_field(name, bad):
    with pytest.raises(ValueError, match=name):
        CollectiveTransport(**{name: bad})


@pytest.mark.parametrize("bad", ["", "h" * 100_000, None, 2**64])
def test_a_host_must_be_a_name(bad):
    with pytest.raises(ValueError, match="host"):
        CollectiveTransport(host=bad)
