"""The bind shim in a process that was started without it: TensorFlow's ``bind`` re-pointed at it in place.

``LD_PRELOAD`` works only when it is in the environment at exec time, so a kernel started by plain
``jupyter lab``, VS Code, JupyterHub or papermill, and a ``python script.py``, run TensorFlow with libc's
``bind``: the process's own TensorFlow client port (opened at its first remote op) listened on every
interface. Here the shim is loaded with ``dlopen`` and the ``bind`` entries of TensorFlow's own
libraries' global offset tables (the slots their calls to ``bind`` jump through) are pointed at the
shim's ``bind``: only TensorFlow's sockets are concerned, nothing else in the process (its Python
sockets, Jupyter's ZeroMQ ones) changes. Done before this process's first TensorFlow server starts
(``connection.connect``); ``containment.listeners`` then checks what it listens on.

Linux on x86_64 and aarch64 (ELF, glibc's ``dl_iterate_phdr``, called in the shim); elsewhere ``protect_tensorflow``
says why it cannot, and the exposure warning names the open port.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
import sys
import threading

from .containment import ContainmentError, shim_path

_RELOCATIONS = {"x86_64": (7, 6), "aarch64": (1026, 1025)}  # (JUMP_SLOT, GLOB_DAT) relocation types
_DT_NULL, _DT_PLTRELSZ, _DT_STRTAB, _DT_SYMTAB, _DT_RELA, _DT_RELASZ, _DT_STRSZ, _DT_JMPREL = 0, 2, 5, 6, 7, 8, 10, 23
_PROT = {"r": mmap.PROT_READ, "w": mmap.PROT_WRITE, "x": mmap.PROT_EXEC}
_RELA = [("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")]  # Elf64_Rela
_SYM = [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"), ("size", "<u8")]  # Elf64_Sym
_LOCK = threading.Lock()
_PATCHED: dict[int, str] = {}  # GOT slot address -> the library it belongs to
# (path, load base) -> its bind slots: a library's tables are read once per process. Reading them takes 0.3 s
# with the GIL held (copies of TensorFlow's string tables, searched), and the kernel connects again each time
# its jobs change between strategies: read every time, a job's start stalled the kernel (3.6 s with busy cores).
_SLOTS: dict[tuple[str, int], list[int]] = {}


class _LoadedObject(ctypes.Structure):  # struct workbench_object of bind_shim.c
    _fields_ = [("name", ctypes.c_char_p), ("base", ctypes.c_size_t), ("dynamic", ctypes.c_size_t)]


def loaded_objects(shim: ctypes.CDLL) -> list[tuple[str, int, int]]:
    """``(path, load base, address of its dynamic section)`` of every ELF object loaded in this process.

    The shim's ``workbench_loaded_objects`` walks them (``dl_iterate_phdr``) with the GIL released and calls no
    Python: a Python callback there waited for the GIL while holding the loader's lock, and a thread importing an
    extension module waited for that lock while holding the GIL, for ever.
    """
    try:
        walk = shim.workbench_loaded_objects
    except AttributeError:
        raise ContainmentError("this process loaded an older bind shim, without workbench_loaded_objects (the package "
                               "was upgraded while it ran): restart it") from None
    walk.restype = ctypes.c_size_t
    walk.argtypes = [ctypes.POINTER(_LoadedObject), ctypes.c_size_t]
    size = 1024
    for _ in range(8):  # more objects than room: again, with room for them (a library loaded meanwhile)
        objects = (_LoadedObject * size)()
        count = walk(objects, size)
        if count <= size:
            return [((o.name or b"").decode(errors="replace"), o.base, o.dynamic) for o in objects[:count]]
        size = count + 64
    raise ContainmentError("the process's loaded libraries kept changing while they were read: try again")


def _dynamic_entries(address: int) -> dict[int, int]:
    entries: dict[int, int] = {}
    for i in range(100_000):  # a dynamic section has tens of entries; DT_NULL ends it
        tag = ctypes.c_int64.from_address(address + 16 * i).value
        if tag == _DT_NULL:
            break
        entries.setdefault(tag, ctypes.c_uint64.from_address(address + 16 * i + 8).value)
    return entries


def got_slots(base: int, dynamic: int, symbol: bytes) -> list[int]:
    """Addresses of the global offset table slots through which the object at ``base`` calls ``symbol``."""
    machine = platform.machine()
    if machine not in _RELOCATIONS:
        return []
    wanted = set(_RELOCATIONS[machine])
    entries = _dynamic_entries(dynamic)
    if _DT_SYMTAB not in entries or _DT_STRTAB not in entries:
        return []

    def absolute(value: int) -> int:  # glibc relocates these entries in place; some loaders leave them relative
        return value if value >= base else base + value

    import numpy as np  # TensorFlow's own dependency: a library's relocations number in the hundreds of thousands

    if _DT_STRSZ not in entries:
        return []
    names = _name_offsets(ctypes.string_at(absolute(entries[_DT_STRTAB]), entries[_DT_STRSZ]), symbol)
    if not names:
        return []
    slots = []
    for table, size in ((_DT_JMPREL, _DT_PLTRELSZ), (_DT_RELA, _DT_RELASZ)):
        if table not in entries or not entries.get(size):
            continue
        rows = np.frombuffer(ctypes.string_at(absolute(entries[table]), entries[size]), dtype=_RELA)
        rows = rows[np.isin(rows["info"] & 0xFFFFFFFF, list(wanted))]
        if not len(rows):
            continue
        indices = (rows["info"] >> 32).astype(np.int64)
        symtab = np.frombuffer(ctypes.string_at(absolute(entries[_DT_SYMTAB]), 24 * (int(indices.max()) + 1)), dtype=_SYM)
        slots.extend(base + int(o) for o in rows["offset"][np.isin(symtab["name"][indices], names)])
    return slots


def _name_offsets(strings: bytes, symbol: bytes) -> list[int]:
    """Offsets in a string table at which the name ``symbol`` starts (linkers share tails: "xbind" holds "bind")."""
    found, start = [], strings.find(symbol + b"\0")
    while start != -1:
        found.append(start)
        start = strings.find(symbol + b"\0", start + 1)
    return found


def _protection(address: int) -> int:
    """The current protection of the page holding ``address`` (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return sum(_PROT[c] for c in perms[:3] if c in _PROT)
    raise ContainmentError(f"address {address:#x} is in no mapping of this process")


def _write_slot(slot: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = slot & ~(mmap.PAGESIZE - 1)
    before = _protection(slot)
    if not before & mmap.PROT_WRITE and libc.mprotect(page, mmap.PAGESIZE, before | mmap.PROT_WRITE) != 0:
        raise ContainmentError(f"mprotect failed (errno {ctypes.get_errno()}) for TensorFlow's bind slot at {slot:#x}")
    ctypes.c_void_p.from_address(slot).value = value
    if not before & mmap.PROT_WRITE:
        libc.mprotect(page, mmap.PAGESIZE, before)


def protect_tensorflow() -> list[str]:
    """Point the ``bind`` of every loaded TensorFlow library at the shim's; return the libraries patched.

    Idempotent: each library's tables are read once, later calls check its slots. Raises ``ContainmentError``
    (saying why) where it cannot: not Linux/ELF, no C compiler for the shim, or no TensorFlow library that calls
    ``bind`` (TensorFlow not imported yet, or built another way).
    """
    if not sys.platform.startswith("linux") or platform.machine() not in _RELOCATIONS:
        raise ContainmentError(f"re-pointing bind in a running process needs Linux on x86_64 or aarch64 "
                               f"(this is {sys.platform} on {platform.machine()})")
    with _LOCK:
        shim = ctypes.CDLL(shim_path())
        target = ctypes.cast(shim.bind, ctypes.c_void_p).value
        patched = set()
        for path, base, dynamic in loaded_objects(shim):
            if "tensorflow" not in path:
                continue
            if (path, base) not in _SLOTS:
                _SLOTS[(path, base)] = got_slots(base, dynamic, b"bind")
            for slot in _SLOTS[(path, base)]:
                if ctypes.c_void_p.from_address(slot).value != target:
                    _write_slot(slot, target)
                _PATCHED[slot] = path
                patched.add(path)
        if not patched:
            raise ContainmentError("no loaded TensorFlow library calls bind (import tensorflow first)")
        return sorted(patched)


def patched_libraries() -> list[str]:
    """The TensorFlow libraries whose ``bind`` goes through the shim in this process (by ``protect_tensorflow``)."""
    return sorted(set(_PATCHED.values()))


def protect_or_reason() -> str:
    """``protect_tensorflow()``, unless every interface was asked for (``WORKBENCH_BIND_ADDRESS="*"``); ``""`` when
    TensorFlow's binds go through the shim, else why they do not (for the exposure warning)."""
    import os

    from .containment import BIND_ENV, EVERY_INTERFACE

    if os.environ.get(BIND_ENV) == EVERY_INTERFACE:
        return ""
    try:
        protect_tensorflow()
    except (ContainmentError, OSError) as exc:
        return str(exc)
    return ""
