"""wb.tracking without its tracker installed, and %wb train --tracking, as a user meets them."""

import subprocess
import sys

import pytest

import workbench as wb
from workbench.errors import ConfigurationError
from workbench.magic_args import parser


@pytest.mark.parametrize("name, module", [("MLflow", "mlflow"), ("WandB", "wandb")])
def test_a_tracker_without_its_package_says_what_to_install(name, module):
    code = (f"import sys; sys.modules[{module!r}] = None\n"  # as if not installed: importing it raises ImportError
            "import workbench as wb\n"
            f"try:\n    wb.tracking.{name}()\nexcept wb.ConfigurationError as exc:\n    print(exc)\n")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert f"wb.tracking.{name} need the {module!r} package, which is not installed" in said
    assert f"pip install 'jupyter-tf-workbench[{module}]'" in said or f"pip install {module}" in said


def test_importing_the_workbench_imports_no_tracker():
    code = "import sys, workbench; print(any(m in sys.modules for m in ('mlflow', 'wandb')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip() == "False"


def test_the_magics_tracking_flag_names_a_tracker_or_says_which_there_are():
    args = parser().parse_args(["train", "make_model", "data", "--tracking", "mlflow"])
    assert args.tracking == "mlflow"
    assert type(wb.tracking.callback_for("MLflow")).__name__ == "MLflow"
    with pytest.raises(ConfigurationError, match="unknown tracker 'neptune': pass one of mlflow, wandb"):
        wb.tracking.callback_for("neptune")
