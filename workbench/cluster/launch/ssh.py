"""engines='ssh': ipyparallel's SSH engine launchers, with a lost host and a finished engine taken in stride.

ipyparallel watches each engine it started over SSH from a thread that asks the host every few
seconds whether the process still runs. When the host stops answering (it crashed, its network
went), ``ssh`` fails and that thread died with a ``CalledProcessError`` traceback on stderr, which a
notebook shows in whatever cell runs, while the workbench had already said what it does about the
lost task. Here the engine then counts as stopped: the thread ends, and neither its output file
nor, when the cluster stops, the engine itself is asked of the dead host again. Stopping an engine
that had already exited (the cluster stops its local engines itself first) printed the remote
``ProcessLookupError`` traceback; it is a no-op now.

The options a user gives are the user's: ipyparallel appends a host's port to the very lists it is
given (``ssh_args``, ``scp_args``), so one list passed as both got ssh's ``-p`` and scp's ``-P`` and
ssh then hung; here each engine works on copies. ``scp_args`` left out are taken from ``ssh_args``
where scp has the same option (the key, ``-o`` options...), so a key given once serves both. A
command that fails while an engine starts (``scp`` refused, no Python there) is a
``ClusterStartError`` naming the command, the host and what to check, not a bare
``CalledProcessError``.
"""

from __future__ import annotations

import shlex
import signal
import subprocess

from ipyparallel.cluster.launcher import SSHEngineLauncher as _IPPEngineLauncher
from ipyparallel.cluster.launcher import SSHEngineSetLauncher as _IPPEngineSetLauncher

from ...errors import ClusterStartError

# Run by the host's Python: signal the engine unless it is gone already, or unless its pid names a thread since: a
# thread's id is a number of the same series, and a signal to it reaches the whole process the thread is in.
_KILL_UNLESS_GONE = """
import os
def names_a_process(pid):
    try:
        with open("/proc/%d/status" % pid) as status:
            return any(line.split() == ["Tgid:", str(pid)] for line in status)
    except FileNotFoundError:
        return not os.path.isdir("/proc")  # no procfs to ask (macOS): the pid is all there is
    except OSError:
        return False
if names_a_process({pid}):
    try:
        os.kill({pid}, {sig})
    except ProcessLookupError:
        pass
"""


# ssh options scp takes as they are, with a value and without; ssh's -p PORT is scp's -P PORT
_SCP_OPTIONS_WITH_VALUE = {"-i", "-o", "-F", "-J", "-c"}
_SCP_FLAGS = {"-4", "-6", "-C", "-q", "-v"}


def scp_options(ssh_args: list[str]) -> list[str]:
    """The options of ``ssh_args`` that scp understands the same way (``-i KEY``, ``-o OPTION``...), in order."""
    found, args = [], list(ssh_args)
    while args:
        arg = args.pop(0)
        if arg in _SCP_OPTIONS_WITH_VALUE and args:
            found += [arg, args.pop(0)]
        elif arg == "-p" and args:
            found += ["-P", args.pop(0)]
        elif arg in _SCP_FLAGS or (arg.startswith("-o") and len(arg) > 2) or (arg.startswith("-i") and len(arg) > 2):
            found.append(arg)
    return found


def _signal_number(sig: int | str) -> int:
    """``15``, ``"TERM"`` or ``"SIGTERM"`` -> 15 (ipyparallel's launchers take either form)."""
    if isinstance(sig, str):
        return int(getattr(signal, sig if sig.startswith("SIG") else f"SIG{sig}"))
    return int(sig)


class SSHEngineLauncher(_IPPEngineLauncher):
    """One engine on a host reached over SSH."""

    host_lost = False  # its host stopped answering while the engine ran

    def start(self, hostname=None, user=None, port=None):
        self.ssh_args = list(self.ssh_args)  # copies: ipyparallel appends the port to the lists it holds
        self.scp_args = list(self.scp_args) or scp_options(self.ssh_args)
        try:
            return super().start(hostname=hostname, user=user, port=port)
        except subprocess.CalledProcessError as exc:
            raise ClusterStartError(_failed_command(exc, self.location, self.ssh_args)) from None
        except Exception as exc:  # noqa: BLE001 - ipyparallel's own (e.g. "Unable to get remote shell information")
            raise ClusterStartError(_failed_start(f"{type(exc).__name__}: {exc}", self.location, self.ssh_args)) from None

    def wait_one(self, timeout):
        try:
            return super().wait_one(timeout)
        except subprocess.CalledProcessError as exc:
            # the host could not be asked (ssh exits 255 when it does not answer): the engine is lost
            self.log.debug("engine %s on %s: the host did not answer (%s); counted as stopped", self.pid, self.location, exc)
            self.host_lost = True
            return None

    def get_output(self, remove=False):
        if self.host_lost:  # fetching its output file would only time out, then log an error
            return ""
        return super().get_output(remove)

    def signal(self, sig):
        if self.state == "running":
            code = _KILL_UNLESS_GONE.format(pid=int(self.pid), sig=_signal_number(sig))
            self.ssh_sender.check_output_python_code(code, stderr=subprocess.DEVNULL)


class SSHEngineSetLauncher(_IPPEngineSetLauncher):
    """ipyparallel's ``engines='ssh'`` launcher, starting the engines above."""

    launcher_class = SSHEngineLauncher


def _failed_command(exc: subprocess.CalledProcessError, location: str, ssh_args: list[str]) -> str:
    command = exc.cmd if isinstance(exc.cmd, str) else shlex.join(str(part) for part in exc.cmd)
    said = (exc.output or b"").decode(errors="replace") if isinstance(exc.output, bytes) else (exc.output or "")
    return _failed_start(f"`{command}` exited with status {exc.returncode}{': ' + said.strip()[-500:] if said.strip() else ''}",
                         location, ssh_args)


def _failed_start(what: str, location: str, ssh_args: list[str]) -> str:
    return (f"starting an engine on {location!r} over SSH failed: {what}. Check that `ssh {shlex.join(ssh_args)} "
            f"{location} true` runs here without a prompt (the key and options go in ssh_args=; scp takes those it "
            "shares with ssh unless scp_args= is given), and that remote_python exists on that host.")
