"""A throwaway "node" for Ray's cluster launcher: an sshd on 127.0.0.1 that `ray up` reaches with
the local node provider exactly as it reaches a cloud VM, over SSH, rsync and login shells.

Nothing else on the machine sees it, and it sees nothing else:
- sshd runs as init of its own PID namespace (`unshare --pid --mount-proc`). `ray stop`, which
  the launcher runs on the node at `ray up` and `ray down`, kills every Ray process it can see: in
  the namespace that is this cluster's alone. Ending sshd ends every process started through it.
- The login is a throwaway account with uid 0 (the venv's Python lives under /root, which only
  root may enter) whose home is the test's temp dir: the launcher's files (~/raylm,
  ~/ray_bootstrap_config.yaml) land there, never in /root.
- It listens on 127.0.0.1 only, accepts one freshly generated key, and is gone with the test.

Needs root (an account, a namespace) and openssh-server, rsync and netcat (Ray's launcher has no
SSH port setting: its ssh_proxy_command reaches the port through `nc`). As root with apt-get,
missing packages are installed; otherwise `require_tools` names them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from workers.distributed import free_port

# command -> the Debian package that provides it
TOOLS = {
    "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
    "rsync": "rsync",
    "nc": "netcat-openbsd",
    "unshare": "util-linux",
    "useradd": "passwd",
}
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
SSHD_CONFIG = """\
ListenAddress 127.0.0.1
Port {port}
HostKey {root}/ssh_host_ed25519_key
PidFile {root}/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
AllowUsers {user}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
X11Forwarding no
PrintMotd no
MaxSessions 64
MaxStartups 64
"""


@dataclass
class LoopbackNode:
    root: Path  # the test's temp dir: keys, sshd's files, the login's home
    user: str
    home: Path
    key: Path  # the client's private key
    port: int
    sshd: subprocess.Popen

    @property
    def proxy_command(self) -> str:
        return f"nc 127.0.0.1 {self.port}"


def missing_tools() -> dict[str, str]:
    return {cmd: pkg for cmd, pkg in TOOLS.items() if shutil.which(cmd, path=SBIN_PATH) is None}


def require_tools() -> None:
    """Installs what is missing where this runs as root with apt-get; otherwise says what to do."""
    if os.geteuid() != 0:
        raise RuntimeError("the loopback node needs root: it adds an account and a PID namespace")
    missing = missing_tools()
    if missing and shutil.which("apt-get"):
        packages = sorted(set(missing.values()))
        subprocess.run(["apt-get", "install", "-y", "-q", *packages], check=True, timeout=600)
        missing = missing_tools()
    if missing:
        raise RuntimeError(f"missing {sorted(missing)}: install {sorted(set(missing.values()))}")


def start(root: Path) -> LoopbackNode:
    """The node: a login with a fresh key, and sshd serving it on a free loopback port."""
    root.chmod(0o755)
    user = f"raylm-launch-{uuid.uuid4().hex[:8]}"
    home = root / "home"
    key = root / "id_ed25519"
    _keygen(key)
    _keygen(root / "ssh_host_ed25519_key")
    _add_login(user, home, key.with_suffix(".pub").read_text())
    port = free_port()
    config = root / "sshd_config"
    config.write_text(SSHD_CONFIG.format(port=port, root=root, user=user))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    sshd = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        + [shutil.which("sshd", path=SBIN_PATH) or "sshd", "-D", "-e", "-f", str(config)],
        stdout=(root / "sshd.log").open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    node = LoopbackNode(root, user, home, key, port, sshd)
    _wait_listening(node)
    return node


def stop(node: LoopbackNode) -> None:
    """Ends sshd, and with it (init of its PID namespace) everything started through it."""
    if node.sshd.poll() is None:
        node.sshd.terminate()
        try:
            node.sshd.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.sshd.kill()
            node.sshd.wait(timeout=30)
    # --force: userdel refuses an account whose uid has running processes, and uid 0 always has.
    subprocess.run(["userdel", "--force", node.user], check=False, capture_output=True)


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "raylm-launch", "-f", str(path)],
        check=True,
        timeout=60,
    )


def _add_login(user: str, home: Path, public_key: str) -> None:
    # '*': no password, yet not locked ('!'), which sshd without PAM would refuse.
    subprocess.run(
        ["useradd", "--non-unique", "--uid", "0", "--gid", "0", "--no-create-home"]
        + ["--home-dir", str(home), "--shell", "/bin/bash", "--password", "*", user],
        check=True,
        timeout=60,
    )
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(parents=True, mode=0o700)
    home.chmod(0o700)
    (ssh_dir / "authorized_keys").write_text(public_key)
    (ssh_dir / "authorized_keys").chmod(0o600)
    (home / ".bashrc").write_text("")  # a fresh VM has one; the launcher sources it


def _wait_listening(node: LoopbackNode, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if node.sshd.poll() is not None:
            raise RuntimeError(f"sshd exited: {(node.root / 'sshd.log').read_text()}")
        try:
            socket.create_connection(("127.0.0.1", node.port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)  # a bounded poll: sshd binds in another process
    raise TimeoutError(f"sshd not listening on 127.0.0.1:{node.port} after {timeout}s")
