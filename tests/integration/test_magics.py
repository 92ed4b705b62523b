"""%wb / %%wb through a real IPython shell against real clusters."""

import re
import shlex

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from training_helpers import train

import workbench as wb

pytestmark = pytest.mark.cluster

W1 = "/job:worker/replica:0/task:1/device:CPU:0"


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.extension_manager.load_extension("workbench")
    ip.run_cell("import tensorflow as tf", store_history=False)
    return ip


def test_help_lists_every_subcommand_with_an_example(shell, capsys):
    shell.run_line_magic("wb", "help")
    text = capsys.readouterr().out
    for sub in ("start", "status", "scale", "stop", "list", "%%wb on", "train", "placement"):
        assert sub in text


def test_cell_on_a_task_runs_there_and_keeps_its_variables_there(shell, cluster):
    shell.run_cell_magic("wb", f"on worker:1 --name {cluster.name}", "v = tf.Variable(tf.ones([3]))\nx = v * 3\n")
    assert shell.user_ns["x"].device == W1 and shell.user_ns["v"].device == W1
    assert shell.user_ns["x"].numpy().tolist() == [3.0, 3.0, 3.0]
    assert "running" in str(shell.run_line_magic("wb", f"status --name {cluster.name}"))


def test_a_failing_cell_says_which_task_it_ran_on(shell, cluster, capsys):
    shell.run_cell_magic("wb", f"on worker:0 --name {cluster.name}", "tf.debugging.assert_equal(1, 2, message='not equal')\n")
    out = capsys.readouterr()
    assert "not equal" in out.out + out.err
    assert "ran on worker:0" in out.out


def test_spmd_cell_runs_on_every_worker_with_the_all_reduce_group(shell, cluster, capsys):
    cell = ("import json, os\n"
            "import tensorflow as tf\n"
            "total = strategy.reduce('SUM', strategy.run(lambda: tf.constant(float(worker_index + 1))), axis=None)\n"
            "print('sum', float(total), 'worker', worker_index, 'of', num_workers, json.loads(os.environ['TF_CONFIG'])['task'])\n")
    shell.run_cell_magic("wb", f"spmd --name {cluster.name}", cell)
    out = capsys.readouterr().out
    # each worker's section; TensorFlow may add its own warnings to it (once per engine process)
    sections = dict(re.findall(r"^\[(worker:\d)\]\n(.*?)(?=^\[worker:\d\]|\Z)", out, re.M | re.S))
    assert list(sections) == ["worker:0", "worker:1"], out
    assert "sum 3.0 worker 0 of 2 {'type': 'worker', 'index': 0}\n" in sections["worker:0"]
    assert "sum 3.0 worker 1 of 2 {'type': 'worker', 'index': 1}\n" in sections["worker:1"]
    with pytest.raises(UsageError, match="the cell raised on worker:0, worker:1"):
        shell.run_cell_magic("wb", f"spmd --name {cluster.name}", "raise ValueError('bad on purpose')\n")
    out = capsys.readouterr().out
    assert out.count("bad on purpose") >= 2 and "workbench/" not in out


def test_ctrl_c_interrupts_an_spmd_cell_on_the_workers_and_leaves_them_usable(shell, cluster, capsys):
    import _thread
    import threading
    import time

    timer = threading.Timer(3.0, _thread.interrupt_main)  # what Jupyter's interrupt button does to the kernel
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(UsageError, match="interrupted on every worker; the cluster is ready"):
            shell.run_cell_magic("wb", f"spmd --name {cluster.name}", "import time\nfor _ in range(600):\n    time.sleep(0.1)\n")
    finally:
        timer.cancel()
    assert time.monotonic() - started < 30
    shell.run_cell_magic("wb", f"spmd --name {cluster.name}", "print('still here', worker_index)\n")
    assert "still here 1" in capsys.readouterr().out


def test_ctrl_c_during_a_cell_on_a_task_stops_it_and_the_task_stays_usable(shell, cluster, capsys):
    import _thread
    import threading
    import time

    timer = threading.Timer(2.0, _thread.interrupt_main)
    timer.start()
    try:  # ops for up to 60 s: an interrupt that is lost fails the test in a minute, not after the whole loop
        shell.run_cell_magic("wb", f"on worker:1 --name {cluster.name}",
                             "import time\nn, began = 0, time.monotonic()\nwhile time.monotonic() - began < 60:\n"
                             "    n += int(tf.reduce_sum(tf.ones([4])))\n")
    finally:
        timer.cancel()
    out = capsys.readouterr()
    assert "KeyboardInterrupt" in out.out + out.err
    assert "interrupted on worker:1" in out.out
    assert shell.user_ns["n"] > 0 and time.monotonic() - shell.user_ns["began"] < 30  # it stopped part way
    shell.run_cell_magic("wb", f"on worker:1 --name {cluster.name}", "after = tf.ones([2]) * 2\n")
    assert shell.user_ns["after"].numpy().tolist() == [2.0, 2.0]


def test_train_and_placement_wrap_the_api(shell, cluster):
    shell.run_cell("import keras, workbench as wb\n"
                   "def make_model():\n"
                   "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, name='h'), keras.layers.Dense(10)])\n",
                   store_history=False)
    shell.user_ns["digits"] = wb.datasets.digits
    job = shell.run_line_magic("wb", f"train make_model digits --loss sparse_categorical_crossentropy --strategy sync-ps "
                                     f"--steps 20 --metrics accuracy --wait --name {cluster.name}")
    assert job.state == "finished" and len(job.history) == 20 and shell.user_ns["_wb_job"] is job
    table = shell.run_line_magic("wb", "placement")
    assert set(table.by_layer().values()) == {"ps:0"}


def test_an_interrupt_during_wb_train_wait_says_in_one_line_that_the_job_goes_on(shell, cluster, capsys):
    import _thread
    import threading
    import time

    shell.run_cell("import keras, workbench as wb\n"
                   "def make_model():\n"
                   "    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(16), keras.layers.Dense(10)])\n",
                   store_history=False)
    shell.user_ns["digits"] = wb.datasets.digits
    timer = threading.Timer(3.0, _thread.interrupt_main)
    timer.start()
    began = time.monotonic()
    try:
        returned = shell.run_line_magic("wb", f"train make_model digits --loss sparse_categorical_crossentropy "
                                              f"--steps 3000 --wait --name {cluster.name}")
    finally:
        timer.cancel()
    assert returned is None and time.monotonic() - began < 3.0 + 2.0
    job = shell.user_ns["_wb_job"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Interrupted")]
    assert len(lines) == 1 and re.fullmatch(
        rf"Interrupted: job {job.name} \(running, \d+/3000 steps\) goes on in the background; "
        rf"cluster\.jobs\['{job.name}'\]\.stop\(\) stops it", lines[0]), lines
    assert job.state == "running"
    job.stop(60)
    assert job.state == "cancelled"


def test_dashboard_magic_opens_the_live_dashboard_or_serves_it(shell, cluster):
    board = shell.run_line_magic("wb", f"dashboard --name {cluster.name}")
    assert isinstance(board, wb.Dashboard) and board.cluster is cluster
    assert list(board.components) == ["progress", "throughput", "timeline"]
    server = shell.run_line_magic("wb", f"dashboard --serve --name {cluster.name}")
    assert server is wb.serve_dashboard(cluster) and "plots.json" in server._repr_html_()
    job = train(cluster, strategy=wb.AsyncPS(steps_per_call=5), steps=20).wait(300)
    named = shell.run_line_magic("wb", f"dashboard --job {job.name}")
    assert named.job is job and list(named.components) == ["progress", "throughput", "timeline"]
    with pytest.raises(UsageError, match="no job of that name"):
        shell.run_line_magic("wb", "dashboard --job no-such-job")
    with pytest.raises(UsageError, match="--serve serves the cluster"):
        shell.run_line_magic("wb", f"dashboard --serve --job {job.name}")
    with pytest.raises(UsageError, match="seconds"):
        shell.run_line_magic("wb", f"profile nan --name {cluster.name}")


def test_tab_completion_of_subcommands_task_and_cluster_names(shell, cluster):
    from workbench.magics import complete

    assert complete("%wb st") == ["start", "status", "stop"]
    assert complete("%wb ") == list(__import__("workbench.magics").magics.SUBCOMMANDS)
    assert complete(f"%wb status --name {cluster.name[:6]}") == [cluster.name]
    assert "worker:1" in complete("%%wb on w")
    from IPython.core.completer import provisionalcompleter

    with provisionalcompleter():  # what Jupyter asks for on Tab
        offered = {c.text for c in shell.Completer.completions("%wb sta", 7)}
    assert {"start", "status"} <= offered


@pytest.mark.parametrize("line, match", [
    ("", "needs a subcommand"),
    ("launch", "unknown subcommand 'launch'"),
    ("scale", "the following arguments are required: --workers"),
    ("start --ps x", "invalid int value"),
    ("status --name nosuch", "no running cluster named 'nosuch'"),
    ("train f", "the following arguments are required"),
    ("train nosuch_fn nosuch_data --loss mse", "'nosuch_fn' is not defined"),
    ("on worker:1", "are cell magics"),
    ("spmd", "are cell magics"),
    ("start --ps 0 --workers 0", "workers=0 is not allowed"),
    ("placement nosuch", "'nosuch' is not defined"),
    ("status 'unclosed", "check the quotes"),
])
def test_bad_lines_give_a_usage_error(shell, cluster, line, match):
    with pytest.raises(UsageError, match=match):
        shell.run_line_magic("wb", line)


def test_bad_task_names_give_a_usage_error(shell, cluster):
    with pytest.raises(UsageError, match="has no task worker:9"):
        shell.run_cell_magic("wb", f"on worker:9 --name {cluster.name}", "1")
    with pytest.raises(UsageError, match="worker-one"):
        shell.run_cell_magic("wb", f"on worker-one --name {cluster.name}", "1")


_SIDE_EFFECTS = {"start", "stop", "scale", "train", "profile", "dashboard"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(["status", "list", "placement", "on", "help", "--name", "--workers", "worker:1",
                              "ps:0", "-3", "x", "'", "--", "=", "wb-test-shared"]), max_size=5).map(" ".join),
))
def test_random_arguments_never_raise_from_inside(shell, cluster, line):
    try:
        words = shlex.split(line)
    except ValueError:
        words = []
    assume(not (words and words[0] in _SIDE_EFFECTS))
    try:
        shell.run_line_magic("wb", line)
    except UsageError:
        pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=30), st.sampled_from(["worker:1", "ps:0", "worker:2", "ps:-1", "worker:", ":1"])))
def test_random_cell_magic_arguments_never_raise_from_inside(shell, cluster, words):
    for sub in ("on", "spmd"):
        try:
            shell.run_cell_magic("wb", f"{sub} {words} --name nosuch-cluster", "1\n")
        except UsageError:
            pass


def test_several_clusters_by_name_the_last_started_is_the_default(shell, no_leftover_processes, capsys):
    try:
        first = shell.run_line_magic("wb", "start --ps 0 --workers 1 --name wb-test-magic-a")
        second = shell.run_line_magic("wb", "start --ps 0 --workers 1 --name wb-test-magic-b")
        assert "wb-test-magic-a" in str(first) and "wb-test-magic-b" in str(second)
        import gc

        gc.collect()  # nothing but the workbench holds these clusters: they must stay reachable
        assert "wb-test-magic-b" in str(shell.run_line_magic("wb", "status"))  # the default: last started
        shell.run_line_magic("wb", "list")
        listing = capsys.readouterr().out
        assert "* <workbench.Cluster 'wb-test-magic-b'" in listing and "  <workbench.Cluster 'wb-test-magic-a'" in listing
        scaled = shell.run_line_magic("wb", "scale --workers 2 --name wb-test-magic-a")
        assert "worker:1" in str(scaled)
        assert "stopped" in str(shell.run_line_magic("wb", "stop --name wb-test-magic-a"))
        assert "wb-test-magic-b" in str(shell.run_line_magic("wb", "status"))
    finally:
        for cluster in wb.running_clusters():
            if cluster.name.startswith("wb-test-magic-"):
                cluster.stop()


def test_terminal_ipython_gets_text_and_usage_errors_without_a_cluster(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "session.ipy"
    script.write_text("%load_ext workbench\n%wb help\n%wb status\n")
    result = subprocess.run([sys.executable, "-m", "IPython", "--no-banner", "--colors=NoColor", str(script)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert "workbench magics" in output
    assert "UsageError: no cluster is running in this kernel: start one with %wb start" in output
    assert "Traceback" not in output
