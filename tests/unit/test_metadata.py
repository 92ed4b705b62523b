"""The package's metadata says one thing everywhere: name, version, dependency bounds."""

import json
import re
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

import workbench

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(lines) -> dict[str, Requirement]:
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            found[requirement.name.lower().replace("_", "-")] = requirement
    return found


def test_the_version_is_written_once_and_reported_by_the_package():
    package_json = json.loads((ROOT / "extension" / "package.json").read_text())
    assert workbench.__version__ == metadata.version("jupyter-tf-workbench") == package_json["version"]
    written = [p for p in (ROOT / "workbench").rglob("*.py") if re.search(r"^__version__\s*=\s*['\"]", p.read_text(), re.M)]
    assert written == [], f"a version written in {written}: it belongs in extension/package.json only"


def test_binders_requirements_carry_the_packages_bounds():
    ours = _requirements(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["cpu"]
                         + PROJECT["optional-dependencies"]["notebook"])
    binder = _requirements((ROOT / "binder" / "requirements.txt").read_text().splitlines())
    for name, requirement in binder.items():
        assert name in ours, f"binder/requirements.txt names {name}, which pyproject.toml does not"
        assert requirement.specifier == ours[name].specifier, f"{name}: binder {requirement}, pyproject {ours[name]}"


def test_dependencies_whose_private_parts_are_used_have_an_upper_bound():
    ours = _requirements(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["notebook"]
                         + PROJECT["optional-dependencies"]["cpu"])
    for name in ("ipyparallel", "keras", "jupyter-bokeh", "bokeh", "jupyterlab", "tensorflow-cpu"):
        assert any(spec.operator in ("<", "<=", "~=", "==") for spec in ours[name].specifier), f"{name} has no upper bound"
        assert metadata.version(name) in ours[name].specifier, f"{name} {metadata.version(name)} is outside {ours[name]}"


def test_the_unrelated_workbench_distribution_beside_us_is_named_with_what_to_do(tmp_path):
    """PyPI's `workbench` (a different project) ships an import package `workbench` too: importing ours says so."""
    import os
    import subprocess
    import sys

    info = tmp_path / "workbench-0.8.506.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: workbench\nVersion: 0.8.506\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", "import workbench"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "'workbench' 0.8.506 is installed" in proc.stderr and "pip uninstall workbench" in proc.stderr, proc.stderr
    plain = subprocess.run([sys.executable, "-W", "error", "-c", "import workbench"], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path.parent)
    assert plain.returncode == 0, plain.stderr  # without it, no warning at all


def test_every_install_hint_names_this_distribution_not_the_unrelated_one():
    # "workbench" on PyPI is another project: `pip install 'workbench[cpu]'` would install it
    wrong = re.compile(r"pip install\s+['\"]?workbench\[")
    places = [*(ROOT / "workbench").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md"),
              *(ROOT / "notebooks").glob("*.ipynb")]
    found = [str(p.relative_to(ROOT)) for p in places if "_build" not in p.parts and wrong.search(p.read_text())]
    assert found == [], f"an install hint names the unrelated 'workbench' distribution: {found}"
    assert workbench.DISTRIBUTION in workbench._version.install_command("cpu")
