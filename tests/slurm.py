"""A real single-node Slurm for tests run as root: munged, slurmctld and slurmd started by hand in a temp dir.

No systemd and no cgroups (``proctrack/linuxproc``, ``task/none``), accounting off, every state,
spool, log and pid file under the temp dir, munge with a key of its own. ``LocalSlurm`` starts
the three daemons and waits until the node is idle; ``close()`` cancels every job left, stops the
daemons by pid and removes the directory. Every client call runs under ``timeout``: a client that
cannot reach the controller retries for about 10 s per call. The node is declared with ``cpus``
CPUs (more than the machine has, so that a cluster's engines fit; a job asking for more stays
PENDING, which is what a test of that case wants).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import debian
import pytest

from workbench.cluster.launch.reaper import kill_process_trees

TIMEOUT = 30
PACKAGES = ["slurm-wlm", "slurmctld", "slurmd", "slurm-client", "munge"]
COMMANDS = ["slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel", "sinfo"]


def available() -> str:
    """Why a local Slurm cannot run here, or ``""``; installs Slurm and munge when missing and we are root."""
    if os.geteuid() != 0:
        return "a local Slurm (munged, slurmctld, slurmd) needs root (CI runs as root)"
    return debian.ensure(COMMANDS, PACKAGES, "Slurm")


@contextlib.contextmanager
def running(cpus: int = 16) -> Iterator[LocalSlurm]:
    """A ``LocalSlurm`` whose ``SLURM_CONF`` this process (and what it starts: sbatch, kernels) sees, then stopped."""
    cluster = LocalSlurm(cpus=cpus)
    try:
        with pytest.MonkeyPatch.context() as patch:
            for key, value in cluster.env.items():
                patch.setenv(key, value)
            yield cluster
    finally:
        cluster.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """A one-node Slurm cluster of this machine, named ``localhost``; its clients see it through ``env``."""

    def __init__(self, cpus: int = 16, ready_timeout: float = 60.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="wb-slurm-"))
        self.cpus = cpus
        self.pids: dict[str, int] = {}
        try:
            self._configure()
            self._start_munge()
            self._start(["slurmctld", "-f", str(self.conf)], self.dir / "slurmctld.pid")
            self._start(["slurmd", "-f", str(self.conf), "-N", "localhost"], self.dir / "slurmd.pid")
            self._wait_idle(ready_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def env(self) -> dict[str, str]:
        """What a Slurm client (sbatch, squeue, scancel) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _configure(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "munge", "log"):
            (d / sub).mkdir()
        (d / "munge").chmod(0o755)  # munged refuses a socket directory others could write
        self.socket = d / "munge" / "munge.socket"
        self.conf = d / "slurm.conf"
        user = "root"
        self.conf.write_text("\n".join([
            "ClusterName=workbench-test",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.socket}",
            "CredType=cred/munge",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "MpiDefault=none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "KillWait=5",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            "SlurmdParameters=config_overrides",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _start_munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        pidfile = self.dir / "munged.pid"
        subprocess.run([_binary("munged"), "--force", f"--key-file={key}", f"--socket={self.socket}",
                        f"--pid-file={pidfile}", f"--log-file={self.dir / 'log' / 'munged.log'}",
                        f"--seed-file={self.dir / 'munge.seed'}"], check=True, capture_output=True, timeout=TIMEOUT)
        self.pids["munged"] = self._read_pid(pidfile)

    def _start(self, argv: list[str], pidfile: Path) -> None:
        """Start a daemon (it forks into the background) and record its pid from its pid file."""
        result = subprocess.run([_binary(argv[0]), *argv[1:]], capture_output=True, text=True, timeout=TIMEOUT)
        if result.returncode != 0:
            raise RuntimeError(f"{argv[0]} did not start: {result.stderr.strip()}\n{self.logs()}")
        self.pids[argv[0]] = self._read_pid(pidfile)

    @staticmethod
    def _read_pid(pidfile: Path) -> int:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            text = pidfile.read_text().strip() if pidfile.exists() else ""
            if text:
                return int(text)
            time.sleep(0.1)
        raise RuntimeError(f"no pid in {pidfile} after {TIMEOUT} s")

    def run(self, *argv: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster (``squeue``, ``scancel`` ...), never longer than ``timeout``."""
        return subprocess.run(["timeout", str(int(timeout)), *argv], capture_output=True, text=True,
                              env={**os.environ, **self.env}, timeout=timeout + 5)

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-o", "%T", timeout=10).stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node is not idle after {timeout} s (state {state!r})\n{self.logs()}")

    def jobs(self) -> list[str]:
        """``jobid state reason`` of every job Slurm still knows as queued or running."""
        return [line for line in self.run("squeue", "-h", "-o", "%i %T %r").stdout.splitlines() if line.strip()]

    def logs(self) -> str:
        parts = []
        for log in sorted((self.dir / "log").glob("*.log")) if (self.dir / "log").exists() else []:
            parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def close(self) -> None:
        if "slurmctld" in self.pids:
            self.run("scancel", "--full", "--user", "root", timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                kill_process_trees([(pid, 0.0)], grace=10.0)  # the workbench's own: SIGTERM, then SIGKILL
        shutil.rmtree(self.dir, ignore_errors=True)

