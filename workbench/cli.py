"""The ``jupyter-tf-workbench`` command: ``demo`` (headless smoke test of an install), ``list``, ``tutorials``,
``bind-shim``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from .errors import WorkbenchError


def remote_sum_on_each_task(cluster) -> dict[str, float]:
    """Run a small reduction on every task of ``cluster`` through a plain TF client; value by task."""
    import tensorflow as tf

    tf.config.experimental_connect_to_cluster(cluster.spec)
    values = {}
    for record in cluster.tasks:
        with tf.device(f"{record.task.device}/device:CPU:0"):
            values[record.name] = float(tf.reduce_sum(tf.range(1, 101, dtype=tf.float32)).numpy())
    return values


def demo(args: argparse.Namespace) -> int:
    from .cluster import Cluster

    started = time.monotonic()
    with Cluster(ps=args.ps, workers=args.workers, start_timeout=args.timeout) as cluster:
        ready = time.monotonic() - started
        print(cluster.status())
        for task, value in remote_sum_on_each_task(cluster).items():
            print(f"{task}: sum(1..100) computed on the task = {value:g}")
    print(f"cluster ready in {ready:.1f} s; stopped, nothing left running.")
    return 0


def list_command(args: argparse.Namespace) -> int:
    from .cluster import list_clusters

    records = list_clusters()
    print(json.dumps([r.to_json() for r in records], indent=2) if args.json else repr(records))
    return 0


def tutorials_source() -> Path | None:
    """The tutorial notebooks: shipped in the package (a wheel), or the checkout's ``notebooks/`` (an editable install)."""
    package = Path(__file__).resolve().parent
    for place in (package / "tutorials", package.parent / "notebooks"):
        if sorted(place.glob("*.ipynb")):
            return place
    return None


def tutorials_command(args: argparse.Namespace) -> int:
    """Copy the tutorials into ``args.directory`` (made if needed); refuse to overwrite without ``--force``."""
    source = tutorials_source()
    if source is None:
        print("jupyter-tf-workbench: error: this installation has no tutorials (an install from a wheel built "
              "without them?): reinstall jupyter-tf-workbench.", file=sys.stderr)
        return 2
    notebooks = sorted(source.glob("*.ipynb"))
    target = Path(args.directory).expanduser()
    there = [n.name for n in notebooks if (target / n.name).exists()]
    if there and not args.force:
        print(f"jupyter-tf-workbench: error: {target} already has {', '.join(there)}: pass --force to overwrite "
              "them (your changes to them are lost), or choose another directory.", file=sys.stderr)
        return 2
    target.mkdir(parents=True, exist_ok=True)
    for notebook in notebooks:
        shutil.copyfile(notebook, target / notebook.name)
    print(f"copied {len(notebooks)} tutorials to {target}: open them with `jupyter lab {target}` and the "
          "Python 3 (workbench) kernel (01-quickstart.ipynb first).")
    return 0


def bind_shim_command(args: argparse.Namespace) -> int:
    """Print the bind shim's path (building it on first use), for ``LD_PRELOAD``; say why not on stderr."""
    from .cluster.process.containment import ContainmentError, shim_path

    try:
        print(shim_path())
    except ContainmentError as exc:
        print(f"workbench: the bind shim is not available: {exc}. TensorFlow ports will listen on every interface.",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from ._version import DISTRIBUTION, __version__

    parser = argparse.ArgumentParser(prog="jupyter-tf-workbench", description="Distributed TensorFlow workbench")
    parser.add_argument("--version", action="version", version=f"{DISTRIBUTION} {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="start a local cluster, run an op on each task, stop")
    demo_parser.add_argument("--ps", type=int, default=1)
    demo_parser.add_argument("--workers", type=int, default=2)
    demo_parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for start-up")
    demo_parser.set_defaults(run=demo)
    list_parser = commands.add_parser("list", help="list running workbench clusters on this machine")
    list_parser.add_argument("--json", action="store_true")
    list_parser.set_defaults(run=list_command)
    tutorials_parser = commands.add_parser("tutorials", help="copy the tutorial notebooks into a directory")
    tutorials_parser.add_argument("directory", nargs="?", default="workbench-tutorials",
                                  help="where to copy them (default: ./workbench-tutorials)")
    tutorials_parser.add_argument("--force", action="store_true", help="overwrite tutorials already there")
    tutorials_parser.set_defaults(run=tutorials_command)
    shim_parser = commands.add_parser(
        "bind-shim", help="print the path of the library that keeps TensorFlow's ports on loopback (for LD_PRELOAD)",
        description="Start Jupyter with LD_PRELOAD=$(jupyter-tf-workbench bind-shim) so that kernels' TensorFlow ports listen on "
                    "loopback only (make lab and Binder do).")
    shim_parser.set_defaults(run=bind_shim_command)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except WorkbenchError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
