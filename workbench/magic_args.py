"""What ``%wb`` and ``%%wb`` accept: one table of subcommands and their arguments, the parser made from it, and
``%wb help`` written from that parser (so the help lists every flag the parser takes, and nothing else).
"""

from __future__ import annotations

import argparse

from IPython.core.error import UsageError

NAME = ("--name", dict(metavar="NAME", help="the cluster (default: the last one started)"))

# (subcommand, how it is written, the Python API it calls, its arguments as add_argument(*flags, **options))
COMMANDS: list[tuple[str, str, str, list[tuple]]] = [
    ("start", "%wb start", "wb.Cluster(...).start()", [
        ("--ps", dict(type=int, default=1, metavar="1")),
        ("--workers", dict(type=int, default=2, metavar="2")),
        ("--engines", dict(default="local", metavar="local|slurm|mpi|ssh|pbs|...")),
        ("--gpus-per-worker", dict(type=int, default=0, metavar="0")),
        ("--network", dict(metavar="auto|1gbit|...")),
        ("--controller-ip", dict(metavar="ADDRESS", help="an address of this machine the engines can reach")),
        ("--queue", dict(metavar="QUEUE", help="batch launchers: the partition or queue")),
        ("--account", dict(metavar="ACCOUNT", help="batch launchers: the account charged")),
        ("--timelimit", dict(metavar="HH:MM:SS", help="batch launchers: the engines' time limit")),
        ("--option", dict(action="append", default=[], metavar="KEY=VALUE",
                          help="any option of the chosen ipyparallel launcher (a Python literal, or text), "
                               "e.g. --option hosts={'node1':2} --option ssh_args=['-i','key']")),
        NAME]),
    ("status", "%wb status", "cluster.status()", [NAME]),
    ("scale", "%wb scale", "cluster.scale(workers=N)", [("--workers", dict(type=int, required=True, metavar="N")), NAME]),
    ("stop", "%wb stop", "cluster.stop()", [NAME]),
    ("shape", "%wb shape", "cluster.shape(RATE, delay=..., between=...): set the emulated links (needs --network at "
                           "start); `%wb shape off` clears them, `%wb shape` alone prints them", [
        ("rate", dict(nargs="?", metavar="RATE")),
        ("--delay", dict(metavar="0.2ms")),
        ("--between", dict(default="all", metavar="all|ps|worker:1|ps-worker")),
        NAME]),
    ("list", "%wb list", "every cluster this kernel runs, the default first", []),
    ("attach", "%wb attach", "wb.attach(NAME): use a cluster another kernel (or the panel) runs", [
        ("name", dict(metavar="NAME"))]),
    ("on", "%%wb on", "with cluster.device(TASK): <the cell>", [("task", dict(metavar="TASK")), NAME]),
    ("spmd", "%%wb spmd", "wb.run_spmd(cluster, <the cell>): on every worker at once, with `strategy` "
                          "(MultiWorkerMirroredStrategy), `worker_index`, TF_CONFIG", [
        NAME, ("--timeout", dict(type=float, default=600.0, metavar="S"))]),
    ("train", "%wb train", "wb.train(cluster, MODEL_FN, DATA_FN, strategy=wb.SyncPS(...), ...) -> a Job (also in "
                           "`_wb_job`); loss, optimizer, metrics left out: the compiled model's; DATA, NAME: a data "
                           "function or dataset, a list of Keras callbacks, defined in the notebook; --tracking: one run per job "
                           "(wb.tracking.MLflow() or WandB())", [
        ("model", dict(metavar="MODEL_FN")),
        ("data", dict(metavar="DATA_FN")),
        ("--loss", dict(metavar="LOSS")),
        ("--optimizer", dict(metavar="adam")),
        ("--learning-rate", dict(type=float, metavar="LR")),
        ("--metrics", dict(nargs="*", metavar="accuracy")),
        ("--strategy", dict(default="async-ps", metavar="async-ps|sync-ps|allreduce")),
        ("--backup-workers", dict(type=int, metavar="K")),
        ("--transfer", dict(metavar="fp32|bf16|fp16|int8")),
        ("--steps-per-call", dict(type=int, metavar="C")),
        ("--steps", dict(type=int, metavar="N")),
        ("--epochs", dict(type=int, metavar="E")),
        ("--steps-per-epoch", dict(type=int, metavar="S")),
        ("--batch-size", dict(type=int, default=64, metavar="B")),
        ("--validation-data", dict(metavar="DATA")),
        ("--validation-steps", dict(type=int, metavar="V")),
        ("--callbacks", dict(metavar="NAME")),
        ("--tracking", dict(metavar="mlflow|wandb")),
        ("--checkpoint", dict(metavar="DIR")),
        ("--checkpoint-every", dict(type=int, default=0, metavar="N")),
        ("--resume", dict(action="store_true")),
        ("--seed", dict(type=int, metavar="S")),
        ("--wait", dict(action="store_true")),
        NAME]),
    ("placement", "%wb placement", "wb.placement(NAME, or the last job)", [("target", dict(nargs="?", metavar="NAME"))]),
    ("dashboard", "%wb dashboard", "wb.dashboard(cluster): live timeline, throughput and progress (--job: "
                                   "wb.dashboard(job) of the last %wb train job, or of the job named; --serve: "
                                   "wb.serve_dashboard(cluster), Bokeh apps with URLs)", [
        ("--serve", dict(action="store_true")), ("--job", dict(nargs="?", const="", metavar="JOB")), NAME]),
    ("profile", "%wb profile", "cluster.profile(seconds=2): an op-level trace of every task (--save: also a "
                               "Chrome-trace JSON for Perfetto)", [
        ("seconds", dict(nargs="?", type=float, default=2.0, metavar="SECONDS")),
        ("--save", dict(metavar="PATH")), NAME]),
    ("help", "%wb help", "this text", []),
]
SUBCOMMANDS = tuple(name for name, *_ in COMMANDS)
CELL_SUBCOMMANDS = ("on", "spmd")


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` (shown as a one-line message) instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}. Type %wb help for every subcommand with an example.")

    def exit(self, status: int = 0, message: str | None = None):
        raise UsageError(message or f"{self.prog}: see %wb help")


def parser() -> argparse.ArgumentParser:
    """The parser of every ``%wb`` line (the subcommand first)."""
    top = _Parser(prog="%wb", add_help=False)
    commands = top.add_subparsers(dest="command", parser_class=_Parser)
    for name, written, _api, arguments in COMMANDS:
        sub = commands.add_parser(name, prog=written, add_help=False)
        for flag, options in arguments:
            sub.add_argument(flag, **options)
    return top


def launcher_options(pairs: list[str]) -> dict:
    """``--option KEY=VALUE`` pairs as keyword arguments of ``wb.Cluster`` (``parse_launcher_options``)."""
    from .cluster.launch.launchers import parse_launcher_options
    from .errors import ConfigurationError

    try:
        return parse_launcher_options(pairs)
    except ConfigurationError as exc:
        raise UsageError(f"%wb start --option: {exc}") from None


def _usage(written: str, arguments: list[tuple]) -> list[str]:
    """The subcommand and each of its arguments, as a line shows them (``[--flag VALUE]``, ``NAME``...)."""
    parts = [written]
    for flag, options in arguments:
        metavar = options.get("metavar", "")
        if not flag.startswith("-"):
            parts.append(f"[{metavar}]" if options.get("nargs") == "?" else metavar)
        elif options.get("action") == "store_true":
            parts.append(f"[{flag}]")
        else:
            many = options.get("nargs") == "*" or options.get("action") == "append"
            shown = f"{flag} {metavar}{' ...' if many else ''}"
            parts.append(shown if options.get("required") else f"[{shown}]")
    return parts


def _wrapped(parts: list[str], width: int, indent: str, then: str) -> list[str]:
    """``parts`` joined by spaces into lines of at most ``width`` characters, never cutting a part."""
    lines, line = [], ""
    for part in parts:
        if line and len(line) + 1 + len(part) > width:
            lines.append(line)
            line = part
        else:
            line = f"{line} {part}" if line else part
    return [(indent if i == 0 else then) + text for i, text in enumerate([*lines, line])]


def help_text() -> str:
    """``%wb help``: every subcommand with every argument the parser takes, and the API it calls."""
    out = ["workbench magics (each one calls the Python API shown under it)", ""]
    for _name, written, api, arguments in COMMANDS:
        out += _wrapped(_usage(written, arguments), 106, "  ", "      ")
        out += _wrapped(api.split(" "), 100, "        ", "        ")
        notes = [f"{flag}: {options['help']}" for flag, options in arguments if options.get("help") and flag != "--name"]
        out += [line for note in notes for line in _wrapped(note.split(" "), 100, "        ", "          ")]
    out += ["", "--name picks a cluster; without it, the last one started. Examples:",
            "  %wb start --ps 1 --workers 2",
            "  %wb start --engines slurm --workers 8 --controller-ip 10.0.0.5 --queue gpu --account proj42",
            "  %%wb on worker:1",
            "  x = tf.random.normal([2, 2])            # computed in the engine hosting worker:1"]
    return "\n".join(out)
