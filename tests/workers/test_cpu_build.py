"""Loading our C++ libraries never waits on a build lock that nobody will remove.

torch's build lock is a file it creates and deletes: a process killed in between (a replica
killed while it starts) leaves it, and torch's own load waits for it forever.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from workers.layers.backends import cpu_build, cpu_paged
from workers.layers.backends.cpu_build import (
    STALE_LOCK_S,
    _build_dir,
    _clear_stale_lock,
    cpu_isa,
    source_digest,
)


def test_a_built_library_loads_beside_a_lock_left_by_a_dead_process():
    if cpu_paged.load() is None:
        pytest.skip("no C++ compiler here: nothing is built, nothing to lock")
    digest = source_digest([cpu_paged._SOURCE, cpu_paged._HEADER])
    name = f"raylm_paged_decode_{cpu_isa()}_{digest}"  # as build_ops names it
    assert os.path.exists(os.path.join(_build_dir(name), f"{name}.so"))
    lock = os.path.join(_build_dir(name), "lock")
    open(lock, "w").close()  # what a process killed inside torch's load leaves behind
    loaded: list[object] = []
    try:
        thread = threading.Thread(target=lambda: loaded.append(cpu_paged.load.__wrapped__()))
        thread.start()
        thread.join(120)
        assert not thread.is_alive(), "the load waited on a lock nobody holds"
        assert loaded and loaded[0] is not None
        assert os.path.exists(lock)  # a fresh lock may be a live build's: left alone
    finally:
        os.remove(lock)  # also ends torch's wait if the load took the locked path


def test_only_a_lock_older_than_any_build_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fresh, stale = (os.path.join(_build_dir(n), "lock") for n in ("raylm_a_1", "raylm_b_2"))
    for lock in (fresh, stale):
        open(lock, "w").close()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    _clear_stale_lock("raylm_a_1")
    _clear_stale_lock("raylm_b_2")
    _clear_stale_lock("raylm_none_3")  # no lock at all: nothing to do
    assert os.path.exists(fresh) and not os.path.exists(stale)
    assert cpu_build.STALE_LOCK_S >= 300  # longer than a build on a loaded 2-core machine
