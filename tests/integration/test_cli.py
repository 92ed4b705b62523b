import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import workbench

pytestmark = pytest.mark.cluster


def test_workbench_demo_is_a_headless_smoke_test(no_leftover_processes):
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "demo"], capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"{task}: sum(1..100) computed on the task = 5050" in out
    assert "task      engine  host" in out
    assert "stopped, nothing left running" in out
    assert "engines registered" in proc.stderr and "3/3" in proc.stderr  # tqdm's text bar in a terminal


def test_cli_errors_are_one_clear_line():
    proc = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "demo", "--workers", "0"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("jupyter-tf-workbench: error: workers=0 is not allowed: a cluster needs at least one "
                                   "worker: use workers=1 or more.")


def test_bind_shim_prints_the_installed_library_that_keeps_wildcard_binds_on_loopback():
    env = {k: v for k, v in os.environ.items() if k != "WORKBENCH_BIND_SHIM"}
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "bind-shim"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    shim = proc.stdout.strip()
    assert shim == str(Path(workbench.__file__).parent / "cluster" / "process" / "workbench-bind-shim.so")  # built with the package
    probe = """
import socket
for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    s = socket.socket(family); s.bind((wildcard, 0)); print(s.getsockname()[0]); s.close()
s = socket.socket(); s.bind(("127.0.0.2", 0)); print(s.getsockname()[0])  # an explicit address is kept
"""
    for bind_address, expected in ((None, ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.2"]),
                                   ("127.0.0.3", ["127.0.0.3", "::ffff:127.0.0.3", "127.0.0.2"]),
                                   ("*", ["0.0.0.0", "::", "127.0.0.2"])):
        run_env = {**env, "LD_PRELOAD": shim, **({"WORKBENCH_BIND_ADDRESS": bind_address} if bind_address else {})}
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=run_env)
        assert out.stdout.split() == expected, (bind_address, out.stdout, out.stderr)


def test_bind_shim_says_why_it_is_not_available(tmp_path):
    env = {**os.environ, "WORKBENCH_BIND_SHIM": str(tmp_path / "gone.so")}  # as an install built without it
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "bind-shim"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "the bind shim is not available" in proc.stderr and "gone.so" in proc.stderr
    assert "pip install jupyter-tf-workbench" in proc.stderr


def test_version_is_the_distributions():
    proc = subprocess.run([sys.executable, "-m", "workbench.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    package_json = json.loads((Path(__file__).resolve().parents[2] / "extension" / "package.json").read_text())
    assert proc.stdout.strip() == f"jupyter-tf-workbench {package_json['version']}" == f"jupyter-tf-workbench {workbench.__version__}"


def test_tutorials_are_copied_out_and_never_overwritten_without_force(tmp_path):
    def tutorials(*args):
        return subprocess.run([sys.executable, "-m", "workbench.cli", "tutorials", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)

    first = tutorials("mine")
    shipped = sorted((Path(workbench.__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
    assert first.returncode == 0 and f"copied {len(shipped)} tutorials to mine" in first.stdout, first.stderr
    assert [p.read_bytes() for p in sorted((tmp_path / "mine").glob("*.ipynb"))] == [p.read_bytes() for p in shipped]
    (tmp_path / "mine" / shipped[0].name).write_text("my own changes")
    again = tutorials("mine")
    assert again.returncode == 2 and "pass --force" in again.stderr and shipped[0].name in again.stderr
    assert (tmp_path / "mine" / shipped[0].name).read_text() == "my own changes"
    assert tutorials("mine", "--force").returncode == 0
    assert (tmp_path / "mine" / shipped[0].name).read_bytes() == shipped[0].read_bytes()
