"""How many pages a process faults in re-allocating one large block: those of the first allocation at most where
the heap keeps the freed block, every page every time where each block is a mapping of its own (glibc's mmap
threshold under the block's size). ``CODE`` defines ``refaults()`` wherever it is run (an engine, a fresh Python).

The heap's free top goes back to the system first: glibc maps a block of its own only where the heap has no free
room for it, so a top left large by earlier work would hide a threshold under the block's size."""

BLOCK_BYTES = 8 * 2**20
TIMES = 10
MAPPED_PAGES = BLOCK_BYTES // 4096 * TIMES  # each block its own mapping: every page faulted in, every time
CODE = f"""
import ctypes, resource
_libc = ctypes.CDLL(None)
_libc.malloc.restype, _libc.malloc.argtypes, _libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def refaults(size={BLOCK_BYTES}, times={TIMES}):
    _libc.malloc_trim(0)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt  # this thread's: not the other threads' work
    for _ in range(times):
        block = _libc.malloc(size)
        ctypes.memset(block, 1, size)
        _libc.free(block)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
"""
