"""The step channel: each step's pickled SchedulerOutput to every TP rank over one TCP connection
per rank, and each rank's answer back (rank 0's output, the others' acknowledgement).

Why not Ray: a compiled-graph round trip to the actors costs several times a socket round trip
before any payload moves, and a step pays it every time (docs/decisions/0002 has the figures).
Ray still starts the workers and carries every other call; only the per-step hot path goes
through here. A rank's server accepts only a connection that opens with the token its actor
handed the executor over Ray, so nothing else on the network can feed it steps (they are
unpickled).
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!BQ")  # frame kind, payload length
STEP, STOP, OK, ERROR = 1, 2, 3, 4
TOKEN_BYTES = 16


class RankFailedError(RuntimeError):
    """A rank's end of the step channel failed: it raised, closed the connection or timed out."""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(f"rank {rank}: {cause!r}")
        self.rank = rank
        self.cause = cause


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(_HEADER.pack(kind, len(payload)) + payload)


def recv_frame(sock: socket.socket) -> tuple[int, bytearray]:
    kind, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return kind, _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the step channel")
        got += k
    return buf


@dataclass(frozen=True, slots=True)
class ChannelAddress:
    """Where a rank's step server listens, and the token it requires."""

    host: str
    port: int
    token: bytes


class StepServer:
    """A rank's end: accepts the executor's connection, then runs each step it is sent on its own
    thread, answering OK (with execute's result) or ERROR (the pickled exception)."""

    def __init__(
        self,
        host: str,
        execute: Callable[[bytes | bytearray], bytes | None],
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._execute = execute
        self._on_start = on_start
        self._listener = socket.create_server((host, 0))
        self.address = ChannelAddress(
            host, self._listener.getsockname()[1], secrets.token_bytes(TOKEN_BYTES)
        )
        self._thread = threading.Thread(target=self._serve, name="raylm-step-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        if self._on_start is not None:
            self._on_start()
        conn = self._accept()
        self._listener.close()
        with conn:
            while True:
                try:
                    kind, payload = recv_frame(conn)
                except (ConnectionError, OSError):
                    logger.info("step channel closed by the executor")
                    return
                if kind == STOP:
                    return
                try:
                    self._answer(conn, payload)
                except OSError:
                    # The executor left with steps still posted (an engine shut down with
                    # micro-batches in flight): their answers have nowhere to go.
                    logger.info("step channel closed by the executor with a step unanswered")
                    return

    def _accept(self) -> socket.socket:
        """The first connection that presents the token; any other is dropped."""
        while True:
            conn, peer = self._listener.accept()
            conn.settimeout(10)
            try:
                presented = bytes(_recv_exact(conn, TOKEN_BYTES))
            except (ConnectionError, OSError):
                presented = b""
            if hmac.compare_digest(presented, self.address.token):
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
            logger.warning("step channel: dropped a connection from %s without the token", peer)
            conn.close()

    def _answer(self, conn: socket.socket, payload: bytearray) -> None:
        try:
            result = self._execute(payload)
        except Exception as exc:
            send_frame(conn, ERROR, _pickled_error(exc))
            return
        send_frame(conn, OK, result or b"")


def _pickled_error(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))


class StepClient:
    """The executor's end: one connection per rank; step() sends to every rank and returns rank 0's
    answer."""

    def __init__(self, addresses: list[ChannelAddress], connect_timeout_s: float = 30.0) -> None:
        self._socks: list[socket.socket] = []
        try:
            for address in addresses:
                sock = socket.create_connection(
                    (address.host, address.port), timeout=connect_timeout_s
                )
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(address.token)
                self._socks.append(sock)
        except BaseException:
            self.close()
            raise

    def step(self, payload: bytes, timeout_s: float, answer_rank: int = 0) -> bytearray:
        """Broadcast one step; raises RankFailedError naming the first rank that failed to
        answer. Returns answer_rank's answer (the rank that samples: rank 0, or the last
        pipeline stage's first rank)."""
        self.post(payload, timeout_s)
        return self.collect(timeout_s, answer_rank)

    def post(self, payload: bytes, timeout_s: float) -> None:
        """Send one step to every rank without waiting for its answers: several steps may be
        posted before the first is collected (pipeline micro-batches); each rank runs them in
        order and answers in order."""
        for rank, sock in enumerate(self._socks):
            try:
                sock.settimeout(timeout_s)  # bounds every later read and write on the socket
                send_frame(sock, STEP, payload)
            except OSError as exc:
                raise RankFailedError(rank, exc) from exc

    def collect(self, timeout_s: float, answer_rank: int = 0) -> bytearray:
        """Every rank's answer to the oldest posted step not yet collected; answer_rank's."""
        deadline = time.monotonic() + timeout_s
        answers = [self._answer(rank, sock, deadline) for rank, sock in enumerate(self._socks)]
        return answers[answer_rank]

    @staticmethod
    def _answer(rank: int, sock: socket.socket, deadline: float) -> bytearray:
        try:
            # Waited for here, not with settimeout: a post on another thread shares the socket.
            if not select.select([sock], [], [], max(deadline - time.monotonic(), 0))[0]:
                raise TimeoutError
            kind, payload = recv_frame(sock)
        except TimeoutError:
            raise RankFailedError(rank, TimeoutError("no answer within the step timeout")) from None
        except OSError as exc:  # ConnectionError included: the rank's process is gone
            raise RankFailedError(rank, exc) from exc
        if kind == ERROR:
            raise RankFailedError(rank, pickle.loads(payload))
        return payload

    def close(self) -> None:
        """Tell every rank to stop serving and close the connections (never raises)."""
        for sock in self._socks:
            try:
                sock.settimeout(1.0)
                send_frame(sock, STOP)
            except OSError:
                pass
            sock.close()
        self._socks = []
