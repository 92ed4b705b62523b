"""engines='ssh': ipyparallel's SSH engine launchers, with a lost host and a finished engine taken in stride.

ipyparallel watches each engine it started over SSH from a thread that asks the host every few
seconds whether the process still runs. When the host stops answering (it crashed, its network
went), ``ssh`` fails and that thread died with a ``CalledProcessError`` traceback on stderr, which a
notebook shows in whatever cell runs, while the workbench had already said what it does about the
lost task. Here the engine then counts as stopped: the thread ends, and neither its output file
nor, when the cluster stops, the engine itself is asked of the dead host again. Stopping an engine
that had already exited (the cluster stops its local engines itself first) printed the remote
``ProcessLookupError`` traceback; it is a no-op now.
"""

from __future__ import annotations

import signal
import subprocess

from ipyparallel.cluster.launcher import SSHEngineLauncher as _IPPEngineLauncher
from ipyparallel.cluster.launcher import SSHEngineSetLauncher as _IPPEngineSetLauncher

# Run by the host's Python: signal the engine unless it is gone already.
_KILL_UNLESS_GONE = """
import os
try:
    os.kill({pid}, {sig})
except ProcessLookupError:
    pass
"""


def _signal_number(sig: int | str) -> int:
    """``15``, ``"TERM"`` or ``"SIGTERM"`` -> 15 (ipyparallel's launchers take either form)."""
    if isinstance(sig, str):
        return int(getattr(signal, sig if sig.startswith("SIG") else f"SIG{sig}"))
    return int(sig)


class SSHEngineLauncher(_IPPEngineLauncher):
    """One engine on a host reached over SSH."""

    host_lost = False  # its host stopped answering while the engine ran

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
