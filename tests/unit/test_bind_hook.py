"""TensorFlow's ``bind`` re-pointed at the shim in place: each library's tables read once, its slots checked after."""

import ctypes
import subprocess
import sys

import pytest
import tensorflow  # noqa: F401 - its libraries loaded, as in a connecting kernel

from workbench.cluster.process import bind_hook


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bind slots are re-pointed on Linux (ELF) only")
def test_a_second_protection_reads_no_library_again_and_puts_a_changed_slot_back(monkeypatch):
    patched = bind_hook.protect_tensorflow()
    assert any("libtensorflow" in path for path in patched)
    target = ctypes.cast(ctypes.CDLL(bind_hook.shim_path()).bind, ctypes.c_void_p).value
    libc_bind = ctypes.cast(ctypes.CDLL("libc.so.6").bind, ctypes.c_void_p).value  # not the preloaded shim's
    slot = sorted(bind_hook._PATCHED)[0]
    assert libc_bind != target and ctypes.c_void_p.from_address(slot).value == target
    reads = []
    scan = bind_hook.got_slots
    monkeypatch.setattr(bind_hook, "got_slots", lambda *args: reads.append(args) or scan(*args))
    bind_hook._write_slot(slot, libc_bind)  # as if something had put libc's bind back
    try:
        assert bind_hook.protect_tensorflow() == patched
    finally:
        if ctypes.c_void_p.from_address(slot).value != target:
            bind_hook._write_slot(slot, target)
    assert reads == [], "a library's relocation tables were read again"
    assert all(ctypes.c_void_p.from_address(s).value == target for s in bind_hook._PATCHED)


# A thread imports extension modules (each a dlopen, with the GIL held) while this one reads the loaded libraries
# (dl_iterate_phdr, which holds the loader's lock). With a Python callback inside dl_iterate_phdr, both waited for
# ever (measured: the first second of such a run). In a child process, so that a deadlock fails the test, bounded.
_READS_WHILE_A_THREAD_LOADS = """
import ctypes, importlib.util, os, shutil, sys, tempfile, threading, time, _bisect
from workbench.cluster.process import bind_hook
source = _bisect.__file__
copies = []
for i in range(200):  # another path each: each copy is a new dlopen
    os.makedirs(os.path.join(sys.argv[1], str(i)))
    copies.append(shutil.copy(source, os.path.join(sys.argv[1], str(i))))
def load():
    for path in copies:
        importlib.util.module_from_spec(importlib.util.spec_from_file_location("_bisect", path))
loader = threading.Thread(target=load)
loader.start()
shim = ctypes.CDLL(bind_hook.shim_path())
reads = 0
while loader.is_alive() and reads < 100_000:
    assert any("libc" in path for path, _base, _dynamic in bind_hook.loaded_objects(shim))
    reads += 1
loader.join()
print("read the libraries", reads, "times while 200 were loaded", flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bind slots are re-pointed on Linux (ELF) only")
def test_reading_the_loaded_libraries_while_a_thread_loads_others_never_deadlocks(tmp_path):
    import _bisect

    if not getattr(_bisect, "__file__", None):
        pytest.skip("this Python has _bisect built in: no extension module file to load again")
    try:
        ran = subprocess.run([sys.executable, "-c", _READS_WHILE_A_THREAD_LOADS, str(tmp_path)], capture_output=True,
                             text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("reading the loaded libraries deadlocked with a thread loading an extension module")
    assert ran.returncode == 0 and "read the libraries" in ran.stdout, (ran.returncode, ran.stdout, ran.stderr[-2000:])
