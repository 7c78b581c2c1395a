"""set_niceness: every thread of the process, and the threads started later, run at the new
value."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from workers.process import set_niceness

# Run in a child process: a nice value raised here could not be lowered again without privilege.
CHILD = textwrap.dedent("""
    import os, threading
    from workers.process import set_niceness

    release = threading.Event()
    before = threading.Thread(target=release.wait)  # a thread that exists when the value is set
    before.start()
    target = min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)  # raising needs no privilege
    set_niceness(target)
    after = threading.Thread(target=release.wait)  # started afterwards: inherits it
    after.start()
    values = {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}
    release.set()
    print(target, sorted(values))
""")


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's"
)
def test_every_thread_runs_at_the_new_niceness():
    root = (
        Path(__file__).resolve().parents[2]
    )  # this checkout's workers/, whatever the venv points at
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(root)!r})\n" + CHILD],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split(" ", 1)
    target, values = int(out[0]), out[1].strip()
    assert values == f"[{target}]"


@pytest.mark.parametrize("nice", [-21, 20, 2**64])
def test_a_nice_value_outside_linux_range_names_the_setting(nice):
    with pytest.raises(ValueError, match="process_niceness"):
        set_niceness(nice)
