"""Builds our C++ CPU kernels (paged decode, fused layer ops) with torch.utils.cpp_extension.

Each library is built once per machine and CPU capability, cached in torch's extensions
directory (~/.cache/torch_extensions unless TORCH_EXTENSIONS_DIR says otherwise); later processes
only load it. Two things go into its name: the instruction-set variant, so a cache directory
shared between machines never hands one machine code built for another's, and a hash of its
sources, so checkouts with different kernels (another branch's worktree, an older install) never
load each other's library or rebuild over each other. It needs a C++ compiler and ninja (the
`ninja` package is a dependency); without them, or if the build fails, `build_ops` logs a warning
and returns None, and the caller keeps its torch path.

torch guards a build with a lock file that it creates and removes (never holds open), and takes it
on every load, built or not: a process killed inside that window (a replica killed while it
starts or builds) leaves the file behind, and every later process that loads the library waits
for it forever. So a library already built is loaded directly, without torch's lock; and a build
runs under an flock of our own on `raylm.lock` beside it, which the kernel releases when its
holder dies: whoever holds it is the only one inside torch's build, so a torch lock found then
was left by a dead process and is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Vector flags per torch's own view of the CPU.
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}


def put_ninja_on_path() -> None:
    """torch builds with `ninja` from PATH. The pip package (a dependency) installs it in the
    environment's scripts folder, which is on PATH only in an activated venv; CI and `make test`
    run .venv/bin/python directly."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def cpu_isa() -> str:
    """torch's name for this CPU's vector capability: avx512, avx2 or default."""
    return torch.backends.cpu.get_cpu_capability().lower()


def source_digest(paths: Sequence[str]) -> str:
    """The first 12 hex digits of a SHA-256 over the files (sources and the headers they
    include)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def build_ops(
    stem: str,
    sources: Sequence[str],
    namespace: str,
    *,
    probe: str,
    what: str,
    fallback: str,
    headers: Sequence[str] = (),
    flags: Sequence[str] = (),
    variant: str | None = None,
) -> Any | None:
    """torch.ops.<namespace> once `sources` (which register its op `probe`, looked up to check)
    are built and loaded, or None after a warning "<what> unavailable, <fallback>: <error>".

    The library is named raylm_<stem>_<variant>_<digest of sources and headers>, variant
    defaulting to the CPU's ISA (a caller that builds extra instructions, such as VNNI, names its
    own); `flags` add to -O3, OpenMP and the ISA's vector flags."""
    isa = cpu_isa()
    try:
        from torch.utils.cpp_extension import load

        put_ninja_on_path()
        t0 = time.perf_counter()
        name = f"raylm_{stem}_{variant or isa}_{source_digest([*sources, *headers])}"
        if not _load_built(name):
            with _build_lock(name):
                if not _load_built(name):  # built by the holder before us
                    load(
                        name=name,
                        sources=list(sources),
                        extra_cflags=["-O3", "-fopenmp", *flags, *ISA_FLAGS.get(isa, [])],
                        extra_ldflags=["-fopenmp"],
                        is_python_module=False,
                    )
        ops = getattr(torch.ops, namespace)
        getattr(ops, probe)
    except Exception as exc:
        logger.warning("%s unavailable, %s: %r", what, fallback, exc)
        return None
    logger.info("%s ready (%s, %.1fs)", what, variant or isa, time.perf_counter() - t0)
    return ops


def _build_dir(name: str) -> str:
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


def _load_built(name: str) -> bool:
    """Load the library an earlier process built, without torch's lock; False when there is none
    (or it does not load: a link cut short is rebuilt)."""
    path = os.path.join(_build_dir(name), f"{name}.so")
    if not os.path.exists(path):
        return False
    try:
        torch.ops.load_library(path)
    except OSError as exc:
        logger.warning("%s does not load (%r); building it again", path, exc)
        return False
    return True


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold the library's build flock (waiting for a live builder); inside it, a torch lock file
    is a dead builder's and is removed."""
    directory = _build_dir(name)
    with open(os.path.join(directory, "raylm.lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, "lock"))
                logger.warning("%s: removed the build lock of a process that died", name)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
