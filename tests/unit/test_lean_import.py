"""TensorFlow's import the engines' way: Keras's optional companions left out of that import, and of nothing else."""

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, sys, threading
    from workbench.cluster.launch.lean_import import keras_companions_left_out

    seen = {}
    with keras_companions_left_out():
        try:
            import matplotlib
            seen["this thread, inside"] = "imported"
        except ModuleNotFoundError as exc:
            seen["this thread, inside"] = str(exc)
        other = threading.Thread(target=lambda: seen.update(other=__import__("pandas").__name__))
        other.start()  # another thread of the process (an engine's, running a user's code) imports as usual
        other.join(120)
    import matplotlib  # after the block: as usual, a failed import is not remembered
    seen["after"] = matplotlib.__name__
    seen["finders left"] = sum(type(f).__name__ == "_LeaveOut" for f in sys.meta_path)
    print(json.dumps(seen))
""")


def test_only_the_importing_thread_and_only_within_the_block_goes_without():
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    seen = json.loads(child.stdout)
    assert "left out" in seen["this thread, inside"], seen
    assert seen["other"] == "pandas" and seen["after"] == "matplotlib" and seen["finders left"] == 0, seen
