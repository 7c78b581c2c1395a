"""The Serve proxy writes every streamed token: it runs at the engine's priority, not Ray's 15."""

import os
import subprocess

import ray

from deploy.stream_priority import PROXY_TITLE, node_proxies, set_process_niceness


def _fake_proc(root, pid: int, ppid: int, comm: str, title: bytes) -> None:
    entry = root / str(pid)
    entry.mkdir()
    (entry / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1\n")
    (entry / "cmdline").write_bytes(title)


def test_node_proxies_are_the_proxies_this_raylet_started(tmp_path):
    _fake_proc(tmp_path, 10, 7, "ray::ProxyActor", PROXY_TITLE + b"\0")
    # A command name with spaces and a parenthesis: the ppid is read after the last ")".
    _fake_proc(tmp_path, 11, 7, "ray::Proxy (x) y", PROXY_TITLE + b".ready\0")
    _fake_proc(tmp_path, 12, 8, "ray::ProxyActor", PROXY_TITLE + b"\0")  # another cluster's
    _fake_proc(tmp_path, 13, 7, "ray::ServeReplica", b"ray::ServeReplica:raylm:LLMReplica\0")
    (tmp_path / "14").mkdir()  # a process that ended while the folder was read
    (tmp_path / "self").mkdir()
    assert sorted(node_proxies(7, tmp_path)) == [10, 11]
    assert node_proxies(9, tmp_path) == []


def test_set_process_niceness_moves_every_thread_of_another_process():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert set_process_niceness(child.pid, 7)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 7
    finally:
        child.kill()
        child.wait()
    assert not set_process_niceness(child.pid, 7)  # gone: nothing to move, no error


def test_served_proxy_runs_at_deploy_yamls_niceness(smol_url):
    """deploy.yaml says process_niceness 0: the ingress moved its node's proxy there too."""
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process.pid
    proxies = node_proxies(raylet)
    assert len(proxies) == 1
    threads = os.listdir(f"/proc/{proxies[0]}/task")
    assert [os.getpriority(os.PRIO_PROCESS, int(t)) for t in threads] == [0] * len(threads)
