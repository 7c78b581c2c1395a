"""The tensor-parallel tests' tiny Llama (Ray and the other tiny models come from
tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.random_checkpoint import TINY_TP_LLAMA, write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """4 attention heads, 2 KV heads: TP=2 splits KV heads, TP=4 replicates them."""
    return write_random_checkpoint(TINY_TP_LLAMA, str(tmp_path_factory.mktemp("tiny-llama"))).path
