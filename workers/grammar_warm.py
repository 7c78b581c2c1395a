"""Structured decoding built and warmed off the engine thread when a runner starts.

A replica's first constrained request used to stall every stream for seconds: the engine thread
imported llguidance (its torch module pulls in torch._dynamo), and the step waited while the
llguidance tokenizer was built for the first compile. Now the sampling rank starts building both
on a daemon thread as it starts (nothing waits for it), and the first constrained request finds
them ready: its own compile (milliseconds for a typical schema) overlaps its prefill as before.
Compilers are shared by the runners of one process with the same tokenizer (tests, offline
engines), so each model's tokenizer is built once per process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on the warm-up thread: seconds of every replica's start
    from workers.structured import GrammarCompiler, StructuredDecoding

logger = logging.getLogger(__name__)

_compilers: dict[tuple[str, int, float], GrammarCompiler] = {}
_compilers_lock = threading.Lock()


class WarmDecoding:
    """A runner's StructuredDecoding, being built on a daemon thread from the moment it exists."""

    def __init__(
        self,
        tokenizer_key: str,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        compile_timeout_s: float,
        mask_deadline_s: float,
    ) -> None:
        self._future: Future[StructuredDecoding] = Future()
        key = (tokenizer_key, vocab_size, compile_timeout_s)
        args = (key, load_tokenizer, mask_deadline_s)
        threading.Thread(target=self._build, args=args, name="grammar-warm", daemon=True).start()

    def ready(self) -> bool:
        return self._future.done()

    def get(self) -> StructuredDecoding:
        """The decoding (waits only if the warm-up is still running); raises ImportError when
        llguidance cannot be imported."""
        return self._future.result()

    def _build(
        self, key: tuple[str, int, float], load_tokenizer: Callable[[], Any], deadline_s: float
    ) -> None:
        try:
            from workers.structured import StructuredDecoding

            compiler = _shared_compiler(key, load_tokenizer)
            try:
                compiler.warm()
            except Exception as exc:  # the requests' own compiles will say what is wrong
                logger.warning("structured output: warm-up failed: %s", exc)
            self._future.set_result(StructuredDecoding(compiler, deadline_s))
        except BaseException as exc:
            self._future.set_exception(exc)


def _shared_compiler(
    key: tuple[str, int, float], load_tokenizer: Callable[[], Any]
) -> GrammarCompiler:
    from workers.structured import GrammarCompiler

    with _compilers_lock:
        compiler = _compilers.get(key)
        if compiler is None:
            compiler = _compilers[key] = GrammarCompiler(load_tokenizer, key[1], key[2])
        return compiler
