"""The memory estimate for local engines: cgroup limits read from real files laid out as the kernel does."""

import warnings

import heap_probe
import psutil
import pytest

import workbench as wb
from workbench.cluster.machine.memory import (
    ENGINE_BYTES,
    FORKED_ENGINE_BYTES,
    WARM_BYTES,
    GiB,
    MiB,
    container_available,
    engine_memory_warning,
    engines_need,
    trim_memory,
)


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_a_v2_container_with_its_own_namespace_reads_the_mount_itself(tmp_path):
    write(tmp_path / "cgroup.procs", "1\n")
    write(tmp_path / "memory.max", f"{2 * GiB}\n")
    write(tmp_path / "memory.current", f"{GiB}\n")
    write(tmp_path / "memory.stat", f"anon 1\ninactive_file {256 * MiB}\n")
    write(tmp_path / "self", "0::/\n")
    assert container_available(tmp_path, tmp_path / "self") == GiB + 256 * MiB


def test_a_v2_job_cgroup_on_a_host_takes_the_tightest_limit_on_its_path(tmp_path):
    write(tmp_path / "cgroup.procs", "1\n")
    job = tmp_path / "slurm" / "job_7"
    write(tmp_path / "slurm" / "memory.max", f"{8 * GiB}\n")
    write(tmp_path / "slurm" / "memory.current", f"{GiB}\n")
    write(job / "memory.max", "max\n")  # the job itself is unlimited; its parent is not
    write(job / "memory.current", f"{GiB}\n")
    write(tmp_path / "self", "0::/slurm/job_7\n")
    assert container_available(tmp_path, tmp_path / "self") == 7 * GiB


def test_v1_unlimited_and_no_cgroup_at_all_mean_no_container_limit(tmp_path):
    memory = tmp_path / "memory"
    write(memory / "memory.usage_in_bytes", f"{GiB}\n")
    write(memory / "memory.limit_in_bytes", "9223372036854771712\n")
    write(tmp_path / "self", "4:memory:/\n0::/\n")
    assert container_available(tmp_path, tmp_path / "self") is None
    write(memory / "memory.limit_in_bytes", f"{3 * GiB}\n")
    write(memory / "memory.stat", f"total_inactive_file {GiB}\n")
    assert container_available(tmp_path, tmp_path / "self") == 3 * GiB
    assert container_available(tmp_path / "absent", tmp_path / "absent-self") is None


def test_the_warning_says_what_is_needed_what_is_free_and_what_to_do():
    # forked engines (the local default): the warm process once, then each engine's own pages
    assert engine_memory_warning(3, WARM_BYTES + 3 * FORKED_ENGINE_BYTES) is None
    message = engine_memory_warning(4, 256 * MiB, "container")
    assert f"starting 4 engine(s) needs about {engines_need(4) / GiB:.1f} GiB" in message
    assert "forked from a process that imported TensorFlow" in message
    assert "this container has 0.2 GiB free" in message and "Start fewer tasks" in message
    # scaling a running cluster: its warm process is there already
    assert engine_memory_warning(1, FORKED_ENGINE_BYTES, with_warm=False) is None
    # engines started as new processes each import TensorFlow
    assert engine_memory_warning(3, 3 * ENGINE_BYTES, forked=False) is None
    assert f"about {ENGINE_BYTES / MiB:.0f} MiB" in engine_memory_warning(4, GiB, forked=False)


def test_trim_memory_returns_freed_heap_to_the_system():
    chunks = [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB in malloc'd chunks below the mmap threshold
    for chunk in chunks[:-1]:
        chunk[0] = 1
    del chunks[:-1]  # freed, but glibc keeps the pages under the last live chunk
    before = psutil.Process().memory_info().rss
    assert trim_memory() is True  # glibc (this machine): something was released
    assert psutil.Process().memory_info().rss < before - 100 * MiB


# ``workbench.cluster.machine.memory`` loaded alone from the path last on the command line: importing the workbench
# package caps the heaps already (``workbench/__init__.py``)
MEMORY_ALONE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("memory_alone", sys.argv[-1])
memory = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
"""
KEEP_PROBE = heap_probe.CODE + MEMORY_ALONE + """
_libc.mallopt(-3, 128 * 1024)  # what TensorFlow does when it first makes a generator dataset's kernel
capped = refaults()
print(capped, memory.keep_large_blocks_in_heap(), refaults())
"""


def test_large_blocks_stay_in_the_heap_again_once_a_fixed_mmap_threshold_is_undone():
    import subprocess
    import sys

    from workbench.cluster.machine import memory

    done = subprocess.run([sys.executable, "-c", KEEP_PROBE, memory.__file__], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    capped, kept, after = done.stdout.split()
    assert int(capped) > 0.9 * heap_probe.MAPPED_PAGES, capped  # the probe's check: each block was a mapping of its own
    assert kept == "True"
    assert int(after) < heap_probe.MAPPED_PAGES / 4, after  # the first allocation's pages at most


@pytest.mark.cluster
def test_a_local_cluster_that_cannot_fit_warns_before_anything_starts(no_leftover_processes):
    from workbench.cluster.launch.fork_launcher import kept_warm

    kept_warm.release()  # a first start: its warm process is counted (one a stopped cluster kept is in memory already)
    free = psutil.virtual_memory().available
    too_many = (free - WARM_BYTES) // FORKED_ENGINE_BYTES + 1  # one forked engine more than fits here
    cluster = wb.Cluster(ps=0, workers=too_many, name="too-big", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", wb.LowMemoryWarning)  # as a user who turns warnings into errors
        with pytest.raises(wb.ClusterStartError, match=rf"starting {too_many} engine\(s\) needs about"):
            cluster.start()
    assert cluster.state == "failed"


def test_what_a_job_leaves_as_garbage_is_collected_and_handed_back_to_the_system():
    from workbench.cluster.process import connection

    class Held:  # a reference cycle, as a traced loop's functions are: only the collector frees it
        pass

    held = Held()
    held.me, held.chunks = held, [bytearray(64 * 1024) for _ in range(3000)]  # ~190 MiB below the mmap threshold
    for chunk in held.chunks:
        chunk[0] = 1
    pinned = bytearray(64 * 1024)  # a live chunk above them: glibc keeps the freed pages under it until a trim
    del held
    before = psutil.Process().memory_info().rss
    connection.free_garbage()  # what a job's thread calls as the job ends
    assert psutil.Process().memory_info().rss < before - 100 * MiB
    assert pinned[0] == 0


ARENAS_PROBE = MEMORY_ALONE + """
import threading

def allocate(ready, done):  # each thread's first allocations, while all are alive: glibc would give each a heap
    kept = [bytearray(1000) for _ in range(1000)]
    ready.wait()
    done.wait()

def twelve_threads():
    ready, done = threading.Barrier(13), threading.Event()
    threads = [threading.Thread(target=allocate, args=(ready, done)) for _ in range(12)]
    for thread in threads:
        thread.start()
    ready.wait()
    heaps = memory.malloc_arenas()
    done.set()
    for thread in threads:
        thread.join()
    return heaps

if sys.argv[1] == "late":
    twelve_threads()  # a process with more than 8 heaps already (a Jupyter kernel has a dozen at its start)
if sys.argv[1] == "import":
    import workbench
    capped = "imported"
else:
    capped = memory.cap_malloc_arenas()
print(capped, twelve_threads())
"""


@pytest.mark.parametrize("environment, when, capped, most", [({}, "early", "True", 2), ({}, "import", "imported", 2),
                                                              ({"MALLOC_ARENA_MAX": "4"}, "early", "False", 4),
                                                              ({}, "late", "False", 13)])
def test_a_processs_threads_share_two_heaps_unless_it_is_too_late_or_the_environment_says_how_many(environment, when,
                                                                                                 capped, most):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | environment
    from workbench.cluster.machine import memory

    done = subprocess.run([sys.executable, "-c", ARENAS_PROBE, when, memory.__file__], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    said, arenas = done.stdout.split()
    assert said == capped  # too late: glibc fixed its limit once the process had more than 8 heaps
    assert 1 <= int(arenas) <= most, arenas  # uncapped, glibc made 13 heaps for these threads here
    if when == "late":
        assert int(arenas) > 8, arenas  # the probe's check: it had the heaps it meant to have


def test_the_workbench_kernel_starts_with_two_heaps_unless_the_user_chose(monkeypatch):
    from workbench.kernel import kernel_command

    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert kernel_command(["-f", "c.json"])[1]["MALLOC_ARENA_MAX"] == "2"  # glibc reads it as the kernel starts
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert kernel_command(["-f", "c.json"])[1]["MALLOC_ARENA_MAX"] == "8"
