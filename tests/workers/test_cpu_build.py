"""Loading our C++ libraries never waits on a build lock that nobody will remove.

torch's build lock is a file it creates and deletes: a process killed in between (a replica
killed while it starts) leaves it, and torch's own load waits for it forever.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from workers.layers.backends import cpu_paged
from workers.layers.backends.cpu_build import _build_dir, _build_lock, cpu_isa, source_digest


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


def test_a_builder_that_died_leaves_no_lock_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = _build_dir("raylm_x_1")
    torch_lock = os.path.join(directory, "lock")
    open(torch_lock, "w").close()  # torch's file, left by the same dead builder
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, os.path.join(directory, "raylm.lock")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        taken = threading.Event()

        def build() -> None:
            with _build_lock("raylm_x_1"):
                taken.set()

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        assert not taken.wait(0.5), "the build lock was taken while a live process held it"
        holder.kill()  # SIGKILL: no cleanup runs in the holder
        assert taken.wait(30), "a dead builder's flock was not released"
        thread.join(5)
    finally:
        holder.kill()
        holder.wait()
    assert not os.path.exists(torch_lock)


HOLD = """
import fcntl, sys, time
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(120)
"""
