"""The reaper kills what a dead client started, closes lifelines, and kills nothing on release."""

import os
import socket
import subprocess
import sys
import time

import psutil
from conftest import wait_gone

from workbench.cluster.launch.reaper import Reaper
from workbench.cluster.machine.processes import find_process, started_at


def _sleeper():
    # a process with a child, like an engine and its nanny
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(1.0)
    return proc


def _lifeline(reaper):
    sock = socket.create_connection(reaper.address, timeout=5)
    sock.sendall(f"wb-x {os.getpid()} {socket.gethostname()}\n".encode())  # as an engine names itself
    return sock


def test_client_death_kills_watched_trees_removes_registry_and_closes_lifelines(tmp_path):
    reaper = Reaper("127.0.0.1")
    proc = _sleeper()
    import psutil

    tree = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(tree) == 2
    registry_file = tmp_path / "c.json"
    registry_file.write_text("{}")
    reaper.watch(proc.pid)
    reaper.remove_on_death(registry_file)
    line = _lifeline(reaper)
    reaper.close(release=False)  # what a dying client does: its end of the pipe closes
    assert not wait_gone(tree, timeout=20)
    proc.wait(timeout=5)
    assert not registry_file.exists()
    line.settimeout(10)
    received = b""
    try:  # the reaper's pings (".", every PING_SECONDS) until it exited, then EOF, or a reset if the token was unread
        while chunk := line.recv(64):  # an engine treats EOF and a reset the same
            received += chunk
            assert len(received) < 1000, "the lifeline stayed open"
    except ConnectionResetError:
        pass
    line.close()
    assert set(received) <= set(b"."), received


def test_release_kills_nothing(tmp_path):
    reaper = Reaper("127.0.0.1")
    proc = _sleeper()
    reaper.watch(proc.pid)
    registry_file = tmp_path / "c.json"
    registry_file.write_text("{}")
    reaper.remove_on_death(registry_file)
    reaper.close(release=True)
    try:
        assert proc.poll() is None
        assert registry_file.exists()
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_lifeline_value_names_the_reaper():
    reaper = Reaper("127.0.0.1")
    try:
        host, port, token = reaper.lifeline("wb-x").split()
        assert (host, int(port), token) == ("127.0.0.1", reaper.address[1], "wb-x")
    finally:
        reaper.close()


class _FakeEngine:
    """An engine's end of a lifeline: names itself, then answers pings while ``answering`` is set."""

    def __init__(self, reaper, pid: int, host: str):
        import threading

        self.sock = socket.create_connection(reaper.address, timeout=5)
        self.sock.sendall(f"wb-x {pid} {host}\n".encode())
        self.answering = threading.Event()
        self.answering.set()
        self._thread = threading.Thread(target=self._answer, daemon=True)
        self._thread.start()

    def close(self):
        """As a process's exit does: shut the connection down (a bare close() from another thread can leave a
        blocked recv() holding the socket open, and send no FIN)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _answer(self):
        try:
            while ping := self.sock.recv(64):
                if self.answering.is_set():
                    self.sock.sendall(ping)
        except OSError:
            pass


def _next_event(events, timeout: float = 15.0):
    import queue

    try:
        return events.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the reaper reported nothing within {timeout} s") from None


def test_reaper_reports_silent_alive_lost_and_exited_processes():
    import queue
    import threading

    reaper = Reaper("127.0.0.1")
    events: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [events.put(e) for e in reaper.events()], daemon=True)
    reader.start()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        engine = _FakeEngine(reaper, 4242, "node-7")
        reaper.health(proc.pid)
        time.sleep(1.5)
        assert events.empty(), "an engine that answers its pings is not reported"
        engine.answering.clear()  # like SIGSTOP: connected, but answering nothing
        started = time.monotonic()
        silent = _next_event(events)
        assert silent["event"] == "silent" and (silent["pid"], silent["host"]) == (4242, "node-7")
        assert 2.5 <= time.monotonic() - started <= 6.0 and silent["seconds"] >= 3.0
        engine.answering.set()
        assert _next_event(events) == {"event": "alive", "pid": 4242, "host": "node-7"}
        engine.close()  # the engine died
        assert _next_event(events) == {"event": "lost", "pid": 4242, "host": "node-7"}
        proc.kill()
        proc.wait(timeout=10)
        assert _next_event(events) == {"event": "exited", "pid": proc.pid}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        reaper.close()
    reader.join(10)
    assert not reader.is_alive(), "events() ends when the reaper exits"


def _closed_by_peer(sock, reads: int = 20) -> bool:
    """Whether the other end closes ``sock`` (a ping or two may come first), within ``reads`` reads of its timeout."""
    for _ in range(reads):
        if not sock.recv(64):
            return True
    return False


def test_a_connection_that_is_not_an_engines_is_closed_and_reported_nothing_of():
    import queue
    import threading

    reaper = Reaper("127.0.0.1")
    events: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [events.put(e) for e in reaper.events()], daemon=True)
    reader.start()
    strays = []
    try:
        engine = _FakeEngine(reaper, 4242, "node-7")
        # what a gRPC client retrying an address this port once had sends first, then a line without a pid
        for first in (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"hello there\n", b"x" * 2000):
            stray = socket.create_connection(reaper.address, timeout=5)
            stray.sendall(first)
            strays.append(stray)
        for stray in strays:
            assert _closed_by_peer(stray), "the reaper closes a connection that is not an engine's"
        engine.answering.clear()
        silent = _next_event(events)
        assert (silent["event"], silent["pid"], silent["host"]) == ("silent", 4242, "node-7")  # the engine's, alone
        engine.close()
        assert _next_event(events) == {"event": "lost", "pid": 4242, "host": "node-7"}
    finally:
        for stray in strays:
            stray.close()
        reaper.close()
    reader.join(10)
    assert all(e["pid"] == 4242 for e in list(events.queue)), list(events.queue)


def test_a_client_that_reads_no_events_does_not_stall_the_reaper(tmp_path):
    reaper = Reaper("127.0.0.1")
    proc = _sleeper()
    try:
        reaper.watch(proc.pid)
        for _ in range(3000):  # far more than a pipe buffer holds, none of it read
            line = socket.create_connection(reaper.address, timeout=5)
            line.sendall(b"wb-x 1 h\n")
            line.close()
        reaper.close(release=False)  # the client dies: the reaper must still kill what it watched
        assert not wait_gone([proc.pid], timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.wait(timeout=10)


def test_a_process_is_known_by_its_create_time_read_a_second_apart_but_not_by_a_younger_ones():
    # psutil's create time moves with /proc/stat's btime (whole seconds, from the wall clock)
    me = psutil.Process()
    created = me.create_time()
    assert started_at(me, created) and started_at(me, created - 1.0) and started_at(me, created + 1.0)
    assert not started_at(me, created + 5.0)  # a process started later, now holding the pid


def test_a_process_is_found_by_its_pid_and_create_time_and_never_a_thread_by_its_id():
    me = psutil.Process()
    assert find_process(os.getpid()).pid == os.getpid()
    assert find_process(os.getpid(), me.create_time()).pid == os.getpid()
    assert find_process(os.getpid(), me.create_time() + 5.0) is None  # a later process that took the pid
    assert find_process(0) is None and find_process(-1) is None


# A client whose engine died and whose own new thread then got that engine's number: killing "the engine" by
# pid signalled the client itself (a thread's id names its whole process to kill(2)). In a child process, so
# that a failure ends the child, not the test run.
_KILLS_A_THREAD_ID = """
import threading, time
from workbench.cluster.launch.reaper import kill_process_trees
from workbench.cluster.machine.processes import find_process
ready, done = threading.Event(), threading.Event()
ids = []
def run():
    ids.append(threading.get_native_id())
    ready.set()
    done.wait(30)
thread = threading.Thread(target=run, daemon=True)
thread.start()
ready.wait(30)
assert find_process(ids[0]) is None, "a thread's id was taken for a process"
kill_process_trees([(ids[0], 0.0)], grace=0.0)
time.sleep(0.5)  # a SIGTERM sent would have arrived by now
print("the process lives on")
done.set()
"""


def test_killing_by_a_pid_that_now_names_a_thread_of_another_process_signals_nothing():
    ran = subprocess.run([sys.executable, "-c", _KILLS_A_THREAD_ID], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and "the process lives on" in ran.stdout, (ran.returncode, ran.stdout, ran.stderr[-2000:])
