"""gloo_ranks: one spawned gloo group per world size, shared by the parallel layer tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.workers.gloo_ranks import GlooRanks


@pytest.fixture(scope="session")
def gloo_ranks(tmp_path_factory) -> Iterator[Callable[[int], GlooRanks]]:
    """world -> the live group of that many ranks. One group at a time (idle ranks hold memory):
    asking for another size closes the current one, so tests that share a size run together."""
    current: list[GlooRanks] = []

    def get(world: int) -> GlooRanks:
        if current and (current[0].world != world or not current[0].alive):
            current.pop().close()
        if not current:
            init_file = tmp_path_factory.mktemp(f"gloo{world}") / "init"
            current.append(GlooRanks(world, str(init_file)))
        return current[0]

    yield get
    for group in current:
        group.close()
