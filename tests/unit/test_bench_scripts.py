"""Every benchmark script still speaks the workbench's API: all of them import in one process (their module-level
code runs, as under ``python bench/<script>.py``), their ``main`` not run. A rename the scripts missed fails here,
not on the day someone measures."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"

IMPORT_EACH = """
import importlib.util, sys
sys.path.insert(0, sys.argv[1])
for path in sys.argv[2:]:
    name = "bench_" + path.rsplit("/", 1)[1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    print("imported", path, flush=True)
"""


def test_every_benchmark_script_imports():
    scripts = sorted(str(p) for p in BENCH.glob("*.py"))
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(BENCH), *scripts], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{done.stdout[-1000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.count("imported ") == len(scripts) > 10
