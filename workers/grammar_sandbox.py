"""Client constraints are checked in child processes, so a spec that crashes, runs away or
balloons costs a child and a 400, never the ingress or the caller of `LLM.generate`.

A check is the whole of what the engine will later do with the spec before its first token:
structural bounds (in the caller, in Python), then, in a child, the llguidance validation, the
compile against the model's tokenizer and the first mask. The child has an address-space limit
and the caller a time limit; a child past either is killed and replaced. No torch and no
transformers in the child: it builds its tokenizer from the JSON the caller's fast tokenizer
serialises to.
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import queue
import resource
import subprocess
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from scheduler.structured_output import StructuredOutput
from workers.grammar_bounds import check_bounds

logger = logging.getLogger(__name__)

DEFAULT_CHECK_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024  # address space a check may add to a child's
MAX_REMEMBERED = 256  # accepted constraints whose next check is free
STARTUP_TIMEOUT_S = 120.0  # a child's own start (import, tokenizer), not charged to a request


@dataclass(frozen=True)
class TokenizerSpec:
    """A fast tokenizer as plain data: what llguidance needs to build its own in a child."""

    json: str
    vocab_size: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, hf_tokenizer: Any, vocab_size: int | None = None) -> TokenizerSpec | None:
        """None for a tokenizer without a Rust backend (the check then stops at validation)."""
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        eos = hf_tokenizer.eos_token_id
        return cls(backend.to_str(), vocab_size, () if eos is None else (int(eos),))


class GrammarSandbox:
    """A bounded pool of checker processes (spawned on first use); thread-safe, blocking."""

    def __init__(
        self,
        tokenizer: TokenizerSpec | None,
        processes: int = 2,
        timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
    ) -> None:
        self.tokenizer, self.timeout_s, self.memory_mb = tokenizer, timeout_s, memory_mb
        self._slots = threading.BoundedSemaphore(processes)
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._accepted: OrderedDict[StructuredOutput, None] = OrderedDict()

    def check(self, constraint: StructuredOutput) -> StructuredOutput:
        """The constraint, once it checks out (repeated ones are checked once); ValueError naming
        its field when it is invalid, past the bounds, slower than timeout_s, or past the memory
        budget."""
        with self._lock:
            if constraint in self._accepted:
                self._accepted.move_to_end(constraint)
                return constraint
        self._check(constraint)
        with self._lock:
            self._accepted[constraint] = None
            while len(self._accepted) > MAX_REMEMBERED:
                self._accepted.popitem(last=False)
        return constraint

    def _check(self, constraint: StructuredOutput) -> None:
        check_bounds(constraint)
        with self._slots:
            child = self._take()
            try:
                verdict, text = child.run(constraint, self.timeout_s)
            except _ChildLost as lost:
                self._discard(child)
                raise ValueError(f"{constraint.field_name}: {lost}") from None
            self._idle.put(child)
        if verdict != "ok":
            raise ValueError(text)

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, set()
        for child in children:
            child.kill()

    def _take(self) -> _Child:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            child = _Child(self.tokenizer, self.memory_mb)
            with self._lock:
                self._children.add(child)
            return child

    def _discard(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._children.discard(child)


class _ChildLost(Exception):
    """The child died or overran; the message says which, for the client's 400."""


class _Child:
    """A checker process: a fresh interpreter running this module (not a fork, which would
    copy the caller's threads and memory; not multiprocessing's spawn, which would re-run the
    caller's main module, a Ray worker's included)."""

    def __init__(self, tokenizer: TokenizerSpec | None, memory_mb: int) -> None:
        self.conn, child_end = multiprocessing.Pipe()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *sys.path])}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.grammar_sandbox", str(child_end.fileno())],
            pass_fds=[child_end.fileno()],
            env=env,
            cwd=root,
            stdin=subprocess.DEVNULL,
        )
        child_end.close()
        self.conn.send((tokenizer, memory_mb))
        self.ready = False

    def run(self, constraint: StructuredOutput, timeout_s: float) -> tuple[str, str]:
        if not self.ready:
            self._receive(STARTUP_TIMEOUT_S, "the grammar checker failed to start")
            self.ready = True
        try:
            self.conn.send(constraint)
        except (OSError, EOFError):
            raise _ChildLost("the grammar checker failed; try again") from None
        return self._receive(timeout_s, f"took longer than {timeout_s:g}s to compile")

    def _receive(self, timeout_s: float, overran: str) -> tuple[str, str]:
        try:
            if not self.conn.poll(timeout_s):
                raise _ChildLost(overran)
            return self.conn.recv()
        except (OSError, EOFError):
            # A native crash or the address-space limit: the spec is what killed the child.
            raise _ChildLost(
                "could not be compiled within the grammar checker's memory and stack limits"
            ) from None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.conn.close()


def _serve(conn: Connection) -> None:
    """The child's loop: build the tokenizer once, then answer each constraint in turn."""
    import llguidance

    from workers.grammar import big_stack_pool

    tokenizer, memory_mb = conn.recv()
    ll_tokenizer = None
    if tokenizer is not None:
        ll_tokenizer = llguidance.LLTokenizer(
            tokenizer.json,
            n_vocab=tokenizer.vocab_size,
            eos_token=list(tokenizer.eos_token_ids) or None,
        )
    pool = big_stack_pool(1, "grammar-check")
    _limit_address_space(memory_mb)
    conn.send(("ready", ""))
    while True:
        try:
            constraint = conn.recv()
        except EOFError:  # the caller is gone
            return
        conn.send(pool.submit(_check_in_child, constraint, ll_tokenizer).result())


def _check_in_child(constraint: StructuredOutput, ll_tokenizer: Any) -> tuple[str, str]:
    from workers.grammar import compile_matcher, validate

    try:
        grammar = validate(constraint)
        if ll_tokenizer is not None:
            compile_matcher(ll_tokenizer, constraint).matcher.compute_bitmask()
    except ValueError as exc:
        return "error", str(exc)
    return "ok", grammar


def _limit_address_space(memory_mb: int) -> None:
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
    except OSError:  # no procfs (not Linux): the time limit still holds
        return
    in_use = int(fields["VmSize"].split()[0]) * 1024
    limit = in_use + memory_mb * (1 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
