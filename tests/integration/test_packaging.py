"""The wheel, built from a clean checkout, ships the prebuilt panel: users need no Node.js."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LABEXT = "share/jupyter/labextensions/workbench-labextension"


def test_a_wheel_built_from_a_clean_checkout_ships_the_panel_and_enables_the_server_extension(tmp_path):
    checkout, out = tmp_path / "checkout", tmp_path / "dist"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60).stdout
    for name in filter(None, tracked.decode().split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the work tree is not part of this checkout
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    assert not (checkout / "extension" / "node_modules").exists() and not (checkout / "workbench" / "labextension").exists()
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(checkout)],
                           capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = out.glob("workbench-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = next(n.split("/data/")[0] for n in names if "/data/" in n) + "/data/"
    assert f"{data}{LABEXT}/package.json" in names and f"{data}{LABEXT}/install.json" in names
    assert any(n.startswith(f"{data}{LABEXT}/static/remoteEntry.") for n in names)
    assert f"{data}etc/jupyter/jupyter_server_config.d/workbench.json" in names
    assert not any("node_modules" in n or n.endswith(".ts") for n in names)
