"""The pull protocol under workers/kv_collective.py: a process's outbox served over two-rank
torch.distributed groups (gloo for host tensors, NCCL for CUDA tensors).

The sending rank keeps the payload in an outbox served by its process's `KVServer` (started on the
first send): a TCPStore on `host` for the rendezvous, then one two-rank process group per receiving
process (a "pair"), formed when that process first pulls from this one and kept for the next pulls.
Over the pair the receiver sends a fixed-size request (pull this key, or let it go) and gets a
header and the bytes (three messages a pull); the bytes are the outbox tensor itself, so a CUDA
tensor travels device to device over NCCL. These groups stand apart from the engine's own
tensor-parallel group (a process has one default group; a pair is a ProcessGroup object of its
own), so a rank serves pulls while its engine steps.

Bounds: every wait of the receiver (connecting, forming the pair, each message) ends at its
timeout, and a failure drops the pair (re-formed on the next pull). The outbox holds an entry until
as many receivers as the pull says fetched or released it, for at most `hold_s`, and within
`max_bytes` (oldest dropped first): a receiver that never comes leaks nothing.

At interpreter exit a process says BYE on its pairs and stops its servers' threads (bounded): a
thread left inside a torch.distributed wait would abort the process as it finalizes.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Protocol, cast

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

IDLE_S = 600.0  # a pair unused this long is closed by its server (its client re-forms it first)
SEND_TIMEOUT_S = 30.0  # the server's bound on one reply (the receiver bounds its own wait)
PULL, DONE, BYE = 1, 2, 3  # BYE: the receiver closes the pair (its server's thread ends)
EXIT_JOIN_S = 5.0  # at interpreter exit, the bound on stopping this process's threads
REQUEST = struct.Struct("<BxxxI16s")  # op, readers, key (16 bytes of a uuid4 hex)
TAG_REQUEST, TAG_HEADER, TAG_DATA = 1, 2, 3


@dataclass(frozen=True, slots=True)
class CollectiveRef:
    """Where a payload waits: the sending process's server and the payload's key."""

    host: str
    port: int
    machine: str  # the sender's machine (a loopback host is reachable from there only)
    backend: str  # "gloo" (a host tensor) or "nccl" (a CUDA tensor)
    key: str
    nbytes: int  # of the tensor
    meta: str  # the sender's description of the bytes (JSON), handed back with them
    fallback_copy: bool = False  # the handle's other references are the fallback's copy


def machine_id() -> str:
    """This machine: its host name and boot id (two containers may share a host name)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"


def reachable(ref: CollectiveRef) -> bool:
    """Whether this process can join a pair with ref's server."""
    return not ref.host.startswith("127.") or ref.machine == machine_id()


def wire_backend(device: torch.device) -> str:
    """The pair's backend for a tensor on `device`: NCCL for CUDA, gloo for host memory."""
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"device: KV over collectives moves CPU or CUDA tensors, not {device.type}")


class PairGroup(Protocol):
    """What a pair needs of a process group (ProcessGroupGloo and ProcessGroupNCCL have it)."""

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> dist.Work: ...


def pair_group(
    store: dist.Store, rank: int, backend: str, host: str, timeout_s: float
) -> PairGroup:
    """One side of a two-rank process group outside the default group."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return cast(PairGroup, dist.ProcessGroupGloo(store, rank, 2, opts))
    if backend != "nccl":
        raise ValueError(f"backend: gloo or nccl, got {backend!r}")
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend: a CUDA tensor moves over NCCL, which this process lacks")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    # NCCL pairs a process's current CUDA device with the peer's: two processes on one GPU are
    # refused by NCCL itself (the error ends the pull; the decode side recomputes).
    return cast(PairGroup, dist.ProcessGroupNCCL(store, rank, 2, opts))


def _client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


@dataclass(slots=True)
class _Entry:
    wire: torch.Tensor
    expires: float
    done: int = 0

    @property
    def nbytes(self) -> int:
        return self.wire.numel() * self.wire.element_size()


class KVServer:
    """One process's outbox and the pairs that pull from it."""

    def __init__(self, host: str, hold_s: float, max_bytes: int) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))  # on host only (loopback unless a cluster's address is given)
        sock.listen(128)
        self.host, self.port = host, sock.getsockname()[1]
        self.store = dist.TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=SEND_TIMEOUT_S),
            master_listen_fd=sock.detach(),  # the store owns the socket from here
            use_libuv=False,
        )
        self.hold_s, self.max_bytes = hold_s, max_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.lock = threading.Lock()
        self.num_pairs = 0
        self.stopping, self.next_hello = False, 1
        self.threads: list[threading.Thread] = []
        self._start(self._accept, "kv-collective")
        _stop_at_exit(self)

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self.threads.append(thread)
        thread.start()

    def stop(self, timeout_s: float) -> bool:
        """End the accepting thread and wait (at most timeout_s) for the pairs' threads, which
        end when their receivers say BYE or go; True if none is left."""
        self.stopping = True
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            while thread.is_alive() and time.monotonic() < deadline:
                if thread.name == "kv-collective":  # wake its wait for the next hello
                    self.store.set(f"hello/{self.next_hello}", "")
                thread.join(0.05)
        return not any(thread.is_alive() for thread in self.threads)

    def offer(self, key: str, meta: dict, wire: torch.Tensor) -> CollectiveRef:
        """Hold `wire` for pulls of `key`; `meta` (JSON-able) travels in the reference."""
        entry = _Entry(wire.contiguous(), time.monotonic() + self.hold_s)
        if entry.nbytes > self.max_bytes:
            raise ValueError(f"max_bytes: a payload of {entry.nbytes} bytes exceeds the outbox")
        with self.lock:
            self._expire()
            while self.entries and self._held() + entry.nbytes > self.max_bytes:
                dropped, _ = self.entries.popitem(last=False)
                logger.warning("KV outbox full: transfer %s dropped unfetched", dropped)
            self.entries[key] = entry
        backend = wire_backend(wire.device)
        return CollectiveRef(
            self.host, self.port, machine_id(), backend, key, entry.nbytes, json.dumps(meta)
        )

    def take(self, key: str, readers: int) -> _Entry | None:
        """The entry, counted as read once (gone after `readers` reads); None if it is not here."""
        with self.lock:
            self._expire()
            entry = self.entries.get(key)
            if entry is not None:
                entry.done += 1
                if entry.done >= readers:
                    del self.entries[key]
            return entry

    def held_bytes(self) -> int:
        with self.lock:
            self._expire()
            return self._held()

    def _held(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, e in self.entries.items() if e.expires <= now]:
            logger.warning("KV transfer %s: not fetched within %.0f s, dropped", key, self.hold_s)
            del self.entries[key]

    def _accept(self) -> None:
        """Serve each pair that announces itself (hello/n, in the order of its counter)."""
        store = _client_store(self.host, self.port, SEND_TIMEOUT_S)
        while not self.stopping:
            n = self.next_hello
            try:
                store.wait([f"hello/{n}"], timedelta(seconds=IDLE_S))
            except dist.DistStoreError:  # idle, or a client that took a number and died
                self.next_hello += int(store.add("pairs", 0) > n)
                continue
            if self.stopping:
                return
            self._start(self._serve, f"kv-pair-{n}", n, store.get(f"hello/{n}").decode())
            self.next_hello = n + 1

    def _serve(self, n: int, backend: str) -> None:
        try:
            base = _client_store(self.host, self.port, SEND_TIMEOUT_S)
            group = pair_group(dist.PrefixStore(f"pair/{n}/", base), 0, backend, self.host, IDLE_S)
            self.num_pairs += 1
            while True:
                request = torch.empty(REQUEST.size, dtype=torch.uint8)
                group.recv([request], 1, TAG_REQUEST).wait(timedelta(seconds=IDLE_S))
                op, readers, key = REQUEST.unpack(request.numpy().tobytes())
                if op == BYE:
                    return
                entry = self.take(key.hex(), readers)
                if op == PULL:
                    self._reply(group, entry)
        except Exception as exc:  # the pair is gone (idle, peer died, bad request): its end
            logger.info("KV pair %d closed: %r", n, exc)

    @staticmethod
    def _reply(group: PairGroup, entry: _Entry | None) -> None:
        """The header (the bytes that follow; -1: not here), then the bytes."""
        timeout = timedelta(seconds=SEND_TIMEOUT_S)
        nbytes = -1 if entry is None else entry.nbytes
        group.send([torch.tensor([nbytes])], 1, TAG_HEADER).wait(timeout)
        if entry is not None:
            group.send([entry.wire.view(-1).view(torch.uint8)], 1, TAG_DATA).wait(timeout)


@dataclass(slots=True)
class _Pair:
    group: PairGroup
    backend: str
    used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Puller:
    """A process's pairs with the servers it pulls from, one per (server, backend)."""

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, int, str], _Pair] = {}
        self.lock = threading.Lock()

    def pull(
        self, ref: CollectiveRef, readers: int, timeout_s: float, max_bytes: int
    ) -> torch.Tensor | None:
        """ref's bytes (None: not held there any more); raises when the pair fails, a wait runs
        past timeout_s, or the reply is not the size ref says (or over max_bytes)."""
        if not 0 <= ref.nbytes <= max_bytes:
            raise ValueError(f"KV pull: {ref.nbytes} bytes is out of bounds (max {max_bytes})")
        return self._call(ref, PULL, readers, timeout_s)

    def done(self, ref: CollectiveRef, readers: int, timeout_s: float) -> None:
        """Tell ref's server that one of its readers lets it go without pulling."""
        self._call(ref, DONE, readers, timeout_s)

    def _call(
        self, ref: CollectiveRef, op: int, readers: int, timeout_s: float
    ) -> torch.Tensor | None:
        pair = self._pair(ref, timeout_s)
        try:
            with pair.lock:
                pair.used = time.monotonic()
                request = REQUEST.pack(op, readers, bytes.fromhex(ref.key))
                buffer = torch.frombuffer(bytearray(request), dtype=torch.uint8)
                pair.group.send([buffer], 0, TAG_REQUEST).wait(timedelta(seconds=timeout_s))
                return self._answer(pair, ref.nbytes, timeout_s) if op == PULL else None
        except Exception:
            self._drop(ref)
            raise

    @staticmethod
    def _answer(pair: _Pair, nbytes: int, timeout_s: float) -> torch.Tensor | None:
        deadline = time.monotonic() + timeout_s

        def recv(tensor: torch.Tensor, tag: int) -> torch.Tensor:
            left = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
            pair.group.recv([tensor], 0, tag).wait(left)
            return tensor

        (header,) = recv(torch.empty(1, dtype=torch.int64), TAG_HEADER).tolist()
        if header < 0:
            return None
        if header != nbytes:
            raise ValueError(f"KV pull: the sender has {header} bytes where {nbytes} were named")
        device = "cuda" if pair.backend == "nccl" else "cpu"
        return recv(torch.empty(nbytes, dtype=torch.uint8, device=device), TAG_DATA)

    def _pair(self, ref: CollectiveRef, timeout_s: float) -> _Pair:
        ident = (ref.host, ref.port, ref.backend)
        with self.lock:
            pair = self.pairs.get(ident)
            if pair is not None and time.monotonic() - pair.used < IDLE_S / 2:
                return pair
            # A sender that is gone refuses the connection at once; the store would retry it
            # until the timeout.
            socket.create_connection((ref.host, ref.port), timeout=timeout_s).close()
            store = _client_store(ref.host, ref.port, timeout_s)
            n = store.add("pairs", 1)
            store.set(f"hello/{n}", ref.backend)
            prefixed = dist.PrefixStore(f"pair/{n}/", store)
            group = pair_group(prefixed, 1, ref.backend, ref.host, timeout_s)
            _stop_at_exit(self)
            self.pairs[ident] = pair = _Pair(group, ref.backend)
            return pair

    def _drop(self, ref: CollectiveRef) -> None:
        with self.lock:
            self.pairs.pop((ref.host, ref.port, ref.backend), None)

    def close(self, timeout_s: float) -> None:
        """Say BYE on every pair (its server's thread ends) and forget them."""
        with self.lock:
            pairs, self.pairs = list(self.pairs.values()), {}
        bye = REQUEST.pack(BYE, 0, bytes(16))
        for pair in pairs:
            with pair.lock:
                buffer = torch.frombuffer(bytearray(bye), dtype=torch.uint8)
                try:
                    pair.group.send([buffer], 0, TAG_REQUEST).wait(timedelta(seconds=timeout_s))
                except Exception as exc:  # its server is gone already
                    logger.info("KV pair: BYE not delivered (%r)", exc)


_servers: dict[str, KVServer] = {}
_puller = Puller()
_lock = threading.Lock()
# Releases go out on a thread of their own: a receiver releases on its engine's thread, which
# must not wait for a sender that is slow or gone.
_releases = ThreadPoolExecutor(1, thread_name_prefix="kv-release")


def pull(ref: CollectiveRef, readers: int, timeout_s: float, max_bytes: int) -> torch.Tensor | None:
    """ref's bytes through this process's pairs (None: not held there any more); raises as
    `Puller.pull` does."""
    return _puller.pull(ref, readers, timeout_s, max_bytes)


def release(ref: CollectiveRef, readers: int) -> None:
    """Tell ref's server, on the release thread, that one of its readers lets it go."""
    _releases.submit(_done, ref, readers)


def _done(ref: CollectiveRef, readers: int) -> None:
    try:
        _puller.done(ref, readers, SEND_TIMEOUT_S)
    except Exception as exc:  # the sender drops it within hold_s anyway
        logger.info("KV transfer %s: release not delivered (%r)", ref.key, exc)


def releases_sent() -> None:
    """Wait until every release asked for so far has been sent (or has failed)."""
    _releases.submit(lambda: None).result()


def server(host: str, hold_s: float, max_bytes: int) -> KVServer:
    """This process's server on host (started on first use; its bounds are the first caller's)."""
    with _lock:
        if host not in _servers:
            _servers[host] = KVServer(host, hold_s, max_bytes)
        return _servers[host]


_started: list[KVServer] = []
_pulling: weakref.WeakSet[Puller] = weakref.WeakSet()
_exit_lock = threading.Lock()  # apart from _lock, which server() holds while one starts


def _stop_at_exit(party: KVServer | Puller) -> None:
    """Have _shutdown end party's threads and pairs (registered when the first one starts)."""
    with _exit_lock:
        if not _started and not _pulling:
            atexit.register(_shutdown)
        if isinstance(party, KVServer):
            _started.append(party)
        else:
            _pulling.add(party)


def _shutdown() -> None:
    """End this process's pairs and servers before the interpreter finalizes: a thread still
    inside a torch.distributed wait then would abort the process (std::terminate as it unwinds
    to take back the GIL)."""
    _releases.shutdown(wait=True)
    for puller in list(_pulling):  # a server of this process hears BYE from its own pullers
        puller.close(EXIT_JOIN_S)
    deadline = time.monotonic() + EXIT_JOIN_S
    for outbox in list(_started):
        if not outbox.stop(max(deadline - time.monotonic(), 0.0)):
            logger.warning(
                "KV server on port %d: a pair waits at exit (its peer lives)", outbox.port
            )
