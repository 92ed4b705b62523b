"""A real OpenSSH server on a loopback port, with throwaway host and client keys, for launcher tests.

``LocalSSHD`` runs ``sshd -D`` (in the foreground, so this process owns it) listening on 127.0.0.1
only, or on a given address (a network namespace's). It accepts the one client key it made, for the
user running the tests, and nothing else: no passwords, no PAM, no agent or port forwarding.
``ssh_args`` are the options a client (ipyparallel's SSH launcher) needs to log in with that key
without touching ``~/.ssh``. ``close()`` stops the daemon and every session it runs, and removes
the directory.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import debian

from workbench.cluster.launch.reaper import kill_process_trees

SSHD = "/usr/sbin/sshd"
TIMEOUT = 30
# a client's options for these servers: only the keys it is given, no known-hosts file, never a prompt
CLIENT_OPTIONS = ["-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                  "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", f"ConnectTimeout={TIMEOUT}"]


def available() -> str:
    """Why an sshd cannot run here, or ``""``; installs OpenSSH when missing and we are root."""
    reason = debian.ensure(["sshd", "ssh", "ssh-keygen"], ["openssh-server", "openssh-client"], "OpenSSH")
    if reason:
        return reason
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalSSHD:
    """An sshd on ``host:port`` that lets this user in with its own throwaway key."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, netns: str = "", hostname: str = "",
                 env: dict[str, str] | None = None, own_pids: bool = False) -> None:
        """``netns``: run inside that network namespace (``host`` is then one of its addresses, port 22 by
        default); ``hostname``: in a UTS namespace of its own with that host name, as its sessions see it;
        ``env``: variables every session gets (what a node's scheduler sets, e.g. ``CUDA_VISIBLE_DEVICES``);
        ``own_pids``: in a PID namespace of its own, so the process ids its sessions see are not this
        machine's (as on another host: a remote pid names some unrelated process here, or none)."""
        self.env = dict(env or {})
        self.dir = Path(tempfile.mkdtemp(prefix="wb-sshd-"))
        self.dir.chmod(0o700)
        self.host, self.port = host, port or (22 if netns else free_port(host))
        self.key = self.dir / "client_key"
        self.process: subprocess.Popen | None = None
        try:
            self._keys()
            self._configure()
            command = [SSHD, "-D", "-e", "-f", str(self.conf)]
            if hostname:
                command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *command]
            if own_pids:  # sshd is the namespace's first process: its sessions' pids count from there
                command = ["unshare", "--pid", "--fork", "--mount-proc", *command]
            if netns:
                command = ["ip", "netns", "exec", netns, *command]
            self.log = self.dir / "sshd.log"
            with open(self.log, "wb") as log:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _keys(self) -> None:
        for name in ("host_key", "client_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"workbench-test-{name}",
                            "-f", str(self.dir / name)], check=True, capture_output=True, timeout=TIMEOUT)
        shutil.copy(self.dir / "client_key.pub", self.dir / "authorized_keys")
        (self.dir / "authorized_keys").chmod(0o600)

    def _configure(self) -> None:
        self.conf = self.dir / "sshd_config"
        self.conf.write_text("\n".join([
            f"ListenAddress {self.host}:{self.port}",
            f"HostKey {self.dir / 'host_key'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AllowUsers {getpass.getuser()}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "AllowAgentForwarding no",
            "AllowTcpForwarding no",
            "X11Forwarding no",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",  # scp speaks sftp by default
            *(f"SetEnv {key}={value}" for key, value in self.env.items()),
            "",
        ]))

    @property
    def ssh_args(self) -> list[str]:
        """Client options: this server's key, no known-hosts file, never a prompt."""
        return ["-i", str(self.key), *CLIENT_OPTIONS]

    def run(self, command: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
        """Run ``command`` on this server over SSH."""
        return subprocess.run(["ssh", *self.ssh_args, "-p", str(self.port), f"{getpass.getuser()}@{self.host}", command],
                              capture_output=True, text=True, timeout=timeout)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + TIMEOUT
        result = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            result = self.run("true", timeout=10)
            if result.returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"sshd on {self.host}:{self.port} did not let us in: "
                           f"{result.stderr.strip() if result else ''}\n{self.log.read_text(errors='replace')[-2000:]}")

    def close(self) -> None:
        if self.process is not None:
            kill_process_trees([(self.process.pid, 0.0)], grace=5.0)  # sshd, its sessions and what they run
            self.process.wait(timeout=TIMEOUT)
            self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)
