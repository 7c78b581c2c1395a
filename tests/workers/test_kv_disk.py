"""The disk tier's files (workers/kv_disk.py): private modes whatever the umask, blocks read back
only when their MAC under this process's key holds, and directories of engines whose process is
gone removed by the next engine that starts under the same root."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from workers.kv_disk import HEADER, LOCK_NAME, MAC_BYTES, DiskTier, sweep_orphans

NBYTES = 64
PAYLOAD = memoryview(bytes(range(NBYTES)))
HASH = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask():
    """The loosest umask: modes must not depend on the process's."""
    old = os.umask(0)
    yield
    os.umask(old)


def test_files_are_0600_in_0700_directories(tmp_path, open_umask):
    root = tmp_path / "kv-tier"
    disk = DiskTier(root / "engine-a", 0, NBYTES)
    disk.write(PAYLOAD, HASH)
    assert mode(root) == mode(root / "engine-a") == mode(disk.dir) == 0o700
    files = list(disk.dir.iterdir())
    assert sorted(p.name for p in files) == sorted([LOCK_NAME, disk.path(HASH).name])
    assert all(mode(p) == 0o600 for p in files)


def test_a_block_reads_back_whole(tmp_path):
    disk = DiskTier(tmp_path / "engine", 0, NBYTES)
    disk.write(PAYLOAD, HASH)
    buf = disk.read(HASH)
    assert buf is not None and bytes(buf[HEADER.size : HEADER.size + NBYTES]) == bytes(PAYLOAD)
    assert disk.read(HASH + 1) is None  # no file


def forge(path: Path, payload: bytes) -> None:
    """What someone who can write the file but not read this process's memory can do: a new
    payload, with a checksum they can compute (CRC-32's or a keyless SHA-256 where the MAC goes)."""
    data = path.read_bytes()
    header = data[: HEADER.size]
    digest = hashlib.sha256(header + payload).digest()
    path.write_bytes(header + payload + digest[:MAC_BYTES])


def test_a_forged_payload_is_refused(tmp_path):
    disk = DiskTier(tmp_path / "engine", 0, NBYTES)
    disk.write(PAYLOAD, HASH)
    forge(disk.path(HASH), bytes(NBYTES))
    assert disk.read(HASH) is None


def test_a_file_written_under_another_key_is_refused(tmp_path):
    mine = DiskTier(tmp_path / "engine", 0, NBYTES)
    other = DiskTier(tmp_path / "other", 0, NBYTES)  # another process's tier: another key
    other.write(memoryview(bytes(NBYTES)), HASH)
    mine.path(HASH).write_bytes(other.path(HASH).read_bytes())
    assert mine.read(HASH) is None


def test_a_file_of_another_hash_or_length_is_refused(tmp_path):
    disk = DiskTier(tmp_path / "engine", 0, NBYTES)
    disk.write(PAYLOAD, HASH)
    disk.path(HASH + 1).write_bytes(disk.path(HASH).read_bytes())
    assert disk.read(HASH + 1) is None
    disk.path(HASH).write_bytes(disk.path(HASH).read_bytes() + b"x")
    assert disk.read(HASH) is None


OWNER = """
import sys
from workers.kv_disk import DiskTier
disk = DiskTier(sys.argv[1], 0, 64)
disk.write(memoryview(bytes(64)), 7)
print("ready", flush=True)
sys.stdin.readline()  # holds its directory until told to go
"""


def start_owner(engine_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(engine_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_dead_owners_directory_is_removed_at_start_and_a_live_ones_kept(tmp_path):
    root = tmp_path / "kv-tier"
    dead, live = start_owner(root / "dead"), start_owner(root / "live")
    dead.kill()  # a crash: no clean stop removed its directory
    dead.wait()
    assert (root / "dead" / "rank0").is_dir()
    try:
        new = DiskTier(root / "new", 0, NBYTES)  # held: its lock with it
        assert sorted(p.name for p in root.iterdir()) == ["live", "new"]
        assert any((root / "live" / "rank0").glob("*.kvblock"))
    finally:
        assert live.stdin is not None
        live.stdin.write("\n")
        live.stdin.close()
        live.wait()
    assert sweep_orphans(root) == [root / "live"]  # now gone too
    assert new.dir.is_dir()  # this process holds it


def test_an_older_releases_directory_is_removed_once_its_process_is_gone(tmp_path):
    root = tmp_path / "kv-tier"
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    pid = int(gone.stdout)
    for name in (f"{pid}-abc", f"{os.getpid()}-def"):  # a finished process, and this one
        (root / name / "rank0").mkdir(parents=True)
        (root / name / "rank0" / f"{HASH:032x}.kvblock").write_bytes(b"x")
    (root / "starting").mkdir()  # no lock and no block yet: an engine starting now
    assert sweep_orphans(root) == [root / f"{pid}-abc"]
    assert sorted(p.name for p in root.iterdir()) == sorted([f"{os.getpid()}-def", "starting"])
