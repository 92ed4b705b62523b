"""The fence around other libraries' internals: versions checked at import, TensorFlow's function removal with
the GIL released behaving as TensorFlow's own, functions registered only between changes of the server def, a
strategy's per-device input without autotuning, TensorFlow's malloc setting of generator datasets made ahead, a
traced custom gradient's registration let go, the eager kernels dropped, and Bokeh imported one thread at a time."""

import subprocess
import sys
import textwrap
import warnings

import pytest
import tensorflow as tf

import workbench
from workbench import compat
from workbench.compat import tensorflow as tf_compat


def test_the_installed_libraries_are_the_checked_ones():
    assert compat.unchecked() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", workbench.UncheckedVersionWarning)
        compat.warn_unchecked()


@pytest.mark.parametrize("library, version", [("TensorFlow", "2.20.1"), ("TensorFlow", "2.22.0"), ("Keras", "3.11.0"),
                                              ("ipyparallel", "9.3.0"), ("jupyter_bokeh", "4.2.1")])
def test_a_version_outside_the_checked_range_says_what_may_break_and_what_to_install(library, version):
    message = compat.outside(library, version)
    distributions, lowest, below, features = compat.FENCES[library]
    assert message.startswith(f"{library} {version} is outside {lowest} to below {below}")
    assert features in message and f"pip install '{distributions[0]}>={lowest},<{below}'" in message


@pytest.mark.parametrize("library, version", [("TensorFlow", "2.21.0"), ("TensorFlow", "2.21.3rc1"),
                                              ("Keras", "3.15.1"), ("ipyparallel", "9.2.0"), ("jupyter_bokeh", "4.1.0")])
def test_a_checked_version_says_nothing(library, version):
    assert compat.outside(library, version) == ""


def test_function_registration_and_removal_go_through_the_c_api_on_this_tensorflow():
    assert tf_compat.guard_context_changes() == ""  # "" once installed; else why TensorFlow's binding stays
    assert type(tf_compat.eager_context()).remove_function.__module__ == tf_compat.__name__
    assert type(tf_compat.eager_context()).add_c_function.__module__ == tf_compat.__name__


def test_a_multi_device_iterators_per_device_pipelines_run_without_autotuning_and_still_feed_every_element():
    """What a distribution strategy feeds its replicas from: TensorFlow gives its per-device pipelines default
    options (autotuning on); once ``untuned_device_prefetch`` applied, they have it off and yield as before."""
    from tensorflow.python.data.ops import multi_device_iterator_ops

    if "device_prefetch" not in tf_compat._STATE:  # not applied in this process yet: TensorFlow's default is on
        before = multi_device_iterator_ops.OwnedMultiDeviceIterator(tf.data.Dataset.range(4), ["/cpu:0"])
        assert before._device_iterators[0]._dataset.options().autotune.enabled is not False
    assert tf_compat.untuned_device_prefetch() and tf_compat.untuned_device_prefetch()  # applies here; once
    iterator = multi_device_iterator_ops.OwnedMultiDeviceIterator(tf.data.Dataset.range(8).batch(2), ["/cpu:0"])
    assert iterator._device_iterators[0]._dataset.options().autotune.enabled is False
    assert [next(iterator)[0].numpy().tolist() for _ in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_tensorflows_generator_malloc_setting_is_made_once_and_a_failure_says_why(monkeypatch, caplog):
    from workbench.cluster.machine import memory

    try:
        assert tf_compat.generator_malloc_setting_now() is True
    finally:
        memory.keep_large_blocks_in_heap()  # this process's heap as the workbench's workers keep theirs
    monkeypatch.setattr(tf.data.Dataset, "from_generator", lambda *a, **k: (_ for _ in ()).throw(ValueError("refused")))
    assert tf_compat.generator_malloc_setting_now() is True  # once: nothing is made the second time
    monkeypatch.delitem(tf_compat._STATE, "generator_made")  # as in a process where it was not made yet
    assert tf_compat.generator_malloc_setting_now() is False
    assert "ValueError: refused" in caplog.text and "mmap threshold" in caplog.text


def test_a_traced_custom_gradients_registration_is_listed_and_once_forgotten_its_graph_goes():
    """TensorFlow registers a traced ``tf.custom_gradient`` (as ``ReplicaContext.all_reduce`` is) for good, and the
    registration holds the graph; ``forget_gradients`` drops what ``gradient_registrations`` listed, and only that."""
    import gc
    import weakref

    @tf.custom_gradient
    def doubled(x):
        return 2.0 * x, lambda dy: 2.0 * dy

    def gradient(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = doubled(x)
        return tape.gradient(y, x)

    earlier: list[str] = []
    with tf_compat.gradient_registrations(earlier):  # a registration before the block
        tf.function(gradient).get_concrete_function(tf.TensorSpec([], tf.float32))
    made: list[str] = []
    with tf_compat.gradient_registrations(made):
        concrete = tf.function(gradient).get_concrete_function(tf.TensorSpec([], tf.float32))
    assert len(made) == 1 and made[0].startswith(tf_compat.CUSTOM_GRADIENT) and made != earlier
    assert float(concrete(tf.constant(3.0))) == 2.0  # the gradient is the custom one
    graph = weakref.ref(concrete.graph)
    del concrete
    gc.collect()
    assert graph() is not None  # TensorFlow's registry holds it
    assert tf_compat.forget_gradients(made) == 1 and made == []
    gc.collect()
    assert graph() is None
    assert len(earlier) == 1 and tf_compat.forget_gradients(earlier) == 1  # it stayed till now


def test_the_eager_runtimes_kernels_are_dropped_and_made_again_on_use():
    triple = tf.function(lambda x: 3 * x)
    assert int(triple(tf.constant(2))) == 6
    tf_compat.clear_kernel_cache()
    assert int(triple(tf.constant(2))) == 6 and int(tf.constant(4) + 1) == 5


def test_a_function_registered_through_the_c_api_runs_and_a_clash_fails_as_tensorflows_does():
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.client import pywrap_tf_session
    from tensorflow.python.framework import errors_impl

    tf_compat.guard_context_changes()
    context = tf_compat.eager_context()
    concrete = tf.function(lambda x: x * 5, autograph=False).get_concrete_function(tf.TensorSpec([], tf.int32))
    assert context.has_function(concrete.name) and int(concrete(tf.constant(3)).numpy()) == 15
    # another body under a name the context holds: TensorFlow refuses it, and the error is TensorFlow's type
    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0, name="other")
    with graph._c_graph.get() as c_graph:
        other = pywrap_tf_session.TF_GraphToFunction_wrapper(
            c_graph, concrete.name.decode(), False, [op._c_op for op in graph.get_operations()], [], [], [], [], [],
            None, "")
    try:
        with pytest.raises(errors_impl.OpError, match="duplicate function with name") as ours:
            context.add_c_function(other)
        with pytest.raises(errors_impl.OpError) as theirs:
            pywrap_tfe.TFE_ContextAddFunction(context._handle, other)  # TensorFlow's own binding
        assert type(ours.value) is type(theirs.value) and ours.value.message == theirs.value.message
    finally:
        pywrap_tf_session.TF_DeleteFunction(other)


def test_a_removed_function_is_gone_and_a_second_removal_fails_as_tensorflows_does():
    tf_compat.guard_context_changes()
    context = tf_compat.eager_context()
    concrete = tf.function(lambda x: x + 1).get_concrete_function(tf.TensorSpec([], tf.float32))
    name, definition = concrete.name, concrete.function_def
    assert context.has_function(name)
    context.remove_function(name)
    assert not context.has_function(name)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-existent function"):
        context.remove_function(name.decode() if isinstance(name, bytes) else name)
    context.add_function_def(definition)  # back, for the function's own removal when freed


# A function registered while another thread changed the server def (removing a task) failed with "Client for target
# /job:worker/replica:0/task:2 not found": with a ps and three workers in their own processes and one thread tracing
# new functions on worker:0 while another took worker:2 out of the connection and put it back 300 times, 4 and 3 of
# about 900 registrations failed in two runs, 0 of about 750 in two runs with the registrations taking their turn.
def test_a_function_is_registered_only_while_the_server_def_does_not_change():
    import gc
    import threading
    import time

    tf_compat.guard_context_changes()
    traced, kept = threading.Event(), []

    def trace():
        function = tf.function(lambda x: x * 3.0, autograph=False)
        kept.extend([function, function.get_concrete_function(tf.TensorSpec([], tf.float32))])  # not freed (removed) here
        traced.set()

    def waiting_its_turn(thread) -> bool:
        frame = sys._current_frames().get(thread.ident)
        while frame is not None and not (frame.f_code.co_filename == tf_compat.__file__
                                          and frame.f_code.co_name in ("in_turn", "call")):  # where turns are taken
            frame = frame.f_back
        return frame is not None

    gc.collect()
    gc.disable()  # no freed function's removal (which takes its turn too) in the tracing thread meanwhile
    try:
        with tf_compat.context_change():  # what an update of the connection holds
            tracer = threading.Thread(target=trace, daemon=True)
            tracer.start()
            deadline = time.monotonic() + 60
            while not (traced.is_set() or waiting_its_turn(tracer)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not traced.is_set(), "a function was registered while the server def was being changed"
            assert waiting_its_turn(tracer), "the trace neither registered its function nor waited for its turn in 60 s"
        assert traced.wait(30.0), "the registration did not go on once the change was over"
        tracer.join(30.0)
    finally:
        gc.enable()


# Threads released at once into the workbench's ways into Bokeh, in a fresh process (Bokeh imported for the first
# time): the notebook dashboard's components, a profile's plot, the server the JupyterLab panel has the kernel start,
# and others each going on to a module of its own. Eight threads importing those modules directly, without
# load(), failed in 10 of 10 processes (a _DeadlockError, or "'_Feature' object has no attribute '__all__'"); a
# kernel met "failed to validate GlyphRenderer.view" when its first wb.dashboard() ran beside the panel's plots.
BOKEH_RACE = textwrap.dedent("""
    import importlib, threading
    from workbench.compat import bokeh as bokeh_compat
    from workbench.dashboard.components import make_components
    from workbench.dashboard.profile_view import profile_plot
    from workbench.telemetry.log import EventLog

    def then(module, server=False):
        def way():
            bokeh_compat.load(server)
            importlib.import_module(module)
        return way

    ways = [lambda: make_components(EventLog(), ["worker:0"]), lambda: profile_plot([], [], [], "profile"),
            then("bokeh.server.server", server=True), then("bokeh.models.widgets"), then("bokeh.models.renderers"),
            then("bokeh.application.handlers.function", server=True), then("bokeh.transform"), then("bokeh.layouts")]
    start, errors = threading.Barrier(len(ways)), []
    def run(way):
        start.wait()
        try:
            way()
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
    threads = [threading.Thread(target=run, args=(way,)) for way in ways]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    print(errors or "all imported")
""")


def test_bokeh_is_imported_one_thread_at_a_time():
    for _ in range(2):  # fresh processes
        done = subprocess.run([sys.executable, "-c", BOKEH_RACE], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "all imported", (done.stdout, done.stderr[-3000:])
