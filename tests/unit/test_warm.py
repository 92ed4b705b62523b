"""The warm process's checks and memory layout, and the controller options, without starting a cluster."""

import subprocess
import sys
import textwrap
import threading

from workbench.cluster.launch.launchers import controller_args
from workbench.cluster.launch.warm_client import adopt_import_time, fork_problem, gpu_driver_loaded, import_time_mismatch


def test_variables_read_when_tensorflow_loads_must_match_for_a_fork():
    warm = {"PYTHONPATH": "/a", "TF_CPP_MIN_LOG_LEVEL": "1", "HOME": "/root", "TF_CONFIG": "{}"}
    same = {**warm, "HOME": "/elsewhere", "TF_CONFIG": '{"task": 1}', "WORKBENCH_LIFELINE": "h 1 t"}
    assert import_time_mismatch(warm, same) == []  # per-engine settings are the fork's own
    client = {**warm, "TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE": "False", "TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY": "True"}
    assert import_time_mismatch(warm, client) == []  # a connected kernel's client settings, read at run time
    other = {**warm, "PYTHONPATH": "/b", "LD_PRELOAD": "libx.so", "OMP_NUM_THREADS": "1"}
    assert import_time_mismatch(warm, other) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"]


def test_a_fork_takes_the_warm_processs_import_time_variables_unless_they_were_set_for_the_engines():
    warm = {"PYTHONPATH": "/a", "TF_CPP_MIN_LOG_LEVEL": "1", "HOME": "/root"}
    # the kernel imported scikit-learn after the cluster started: it set two KMP_ variables in its environment
    kernel = {**warm, "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE", "HOME": "/elsewhere"}
    forked = adopt_import_time(kernel, warm)
    assert forked == {"PYTHONPATH": "/a", "TF_CPP_MIN_LOG_LEVEL": "1", "HOME": "/elsewhere"}
    assert import_time_mismatch(warm, forked) == []  # so the fork goes ahead (it was refused: a 3 s new process)
    explicit = {"OMP_NUM_THREADS": "1"}  # set for the engines (engine_env=): a real difference, still refused
    assert import_time_mismatch(warm, adopt_import_time({**kernel, **explicit}, warm, keep=explicit)) == ["OMP_NUM_THREADS"]


def test_a_gpu_driver_is_recognised_in_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert gpu_driver_loaded(str(maps)) == ""
    maps.write_text(maps.read_text() + "7f20-7f30 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libcuda.so.570.1\n")
    assert gpu_driver_loaded(str(maps)) == "/usr/lib/x86_64-linux-gnu/libcuda.so.570.1"
    assert gpu_driver_loaded(str(tmp_path / "absent")) == ""


def test_a_thread_makes_forking_unsafe():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="some-poller", daemon=True)
    thread.start()
    try:
        problem = fork_problem()
        assert "threads" in problem and "some-poller" in problem and "deadlock" in problem
    finally:
        stop.set()
        thread.join(5)


def test_compacting_module_strings_keeps_every_module_and_import_working():
    script = textwrap.dedent("""
        import sys, json, types
        from workbench.cluster.launch.warm import compact_module_strings
        before = [(name, getattr(module, "__file__", None)) for name, module in sys.modules.items()]
        files = {name: id(getattr(module, "__file__", None)) for name, module in sys.modules.items()}
        count = compact_module_strings()
        after = [(name, getattr(module, "__file__", None)) for name, module in sys.modules.items()]
        moved = sum(1 for name, module in sys.modules.items()
                    if isinstance(getattr(module, "__file__", None), str) and id(module.__file__) != files[name])
        import email.parser  # a first import after compaction
        print(json.dumps({"count": count, "same": before == after, "moved": moved, "imported": "email.parser" in sys.modules}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    result = __import__("json").loads(out.stdout)
    assert result["same"] and result["imported"] and result["count"] > 20
    assert result["moved"] > 10  # the __file__ strings are new objects, equal to the old ones


def test_users_controller_options_replace_the_workbench_defaults():
    defaults = controller_args([])
    assert "--IPController.use_threads=True" in defaults and "--HeartMonitor.period=100" in defaults
    mine = controller_args(["--IPController.use_threads=False", "--log-level=20"])
    assert "--IPController.use_threads=True" not in mine and mine[-2:] == ["--IPController.use_threads=False", "--log-level=20"]
    assert "--HeartMonitor.period=100" in mine
