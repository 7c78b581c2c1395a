"""The Serve proxy that writes this node's streams runs at the engine's priority.

Every streamed token crosses three processes after the engine: the replica, the ingress and the
node's Serve proxy (ProxyActor), which writes the SSE bytes to the client's socket. Ray starts
every worker process at nice 15; the replica and the ingress move themselves to
`process_niceness` (0 in deploy.yaml), but the proxy is Serve's and stays at 15. On a machine
whose cores the engine's threads fill, a nice-15 proxy gets about 3% of a core against them (CFS
weights 36 and 1024), and every chunk of every stream waits in its backlog: the client's
inter-token latency became the proxy's pace, not the engine's. The ingress, started on the same
node by the same raylet, moves the proxy to its own priority.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from workers.process import renice_threads

logger = logging.getLogger(__name__)

PROXY_TITLE = b"ray::ProxyActor"  # the process title Ray gives Serve's proxy actor


def node_proxies(raylet_pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of the Serve proxies that raylet_pid started (other clusters' proxies on the same
    machine are not ours to touch)."""
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            title = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not readable
            continue
        if ppid == raylet_pid and title.startswith(PROXY_TITLE):
            pids.append(int(entry.name))
    return pids


def set_process_niceness(pid: int, nice: int, proc: Path = Path("/proc")) -> bool:
    """Every thread of process pid at `nice` (workers/process.py); False when the process is gone
    or may not be changed."""
    try:
        renice_threads(pid, nice, proc)
    except PermissionError:
        logger.warning("Serve proxy %d: cannot set nice %d (needs CAP_SYS_NICE)", pid, nice)
        return False
    except OSError:  # gone meanwhile
        return False
    return True


def align_proxy_priority(nice: int) -> list[int]:
    """Move this node's Serve proxies (children of this worker's raylet) to `nice`; the pids
    moved."""
    moved = [pid for pid in node_proxies(os.getppid()) if set_process_niceness(pid, nice)]
    if moved:
        logger.info("Serve proxy %s set to nice %d (it writes every streamed token)", moved, nice)
    return moved
