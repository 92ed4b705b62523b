"""TensorFlow's ``bind`` re-pointed at the shim in place: each library's tables read once, its slots checked after."""

import ctypes
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
