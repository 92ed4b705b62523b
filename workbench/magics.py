"""``%wb`` and ``%%wb``: notebook magics, a thin layer over the Python API (no logic of their own).

    %load_ext workbench
    %wb start --ps 1 --workers 2        %wb status | scale --workers 4 | stop | list | help
    %%wb on worker:1                    (the cell's ops run on that task; its variables live there)
    %wb train make_model make_data --loss sparse_categorical_crossentropy --strategy sync-ps --steps 500
    %wb placement [name]
    %wb dashboard [--serve]             %wb profile 2 [--save trace.json]

Arguments are parsed once, here; bad ones raise ``UsageError`` saying what to type instead.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from . import training
from .cluster import Cluster, TaskId, running_clusters
from .errors import WorkbenchError

HELP = """\
workbench magics (each one calls the Python API shown on the right)

  %wb start [--ps 1] [--workers 2] [--engines local|slurm|mpi|ssh|pbs|...] [--gpus-per-worker 0]
            [--network auto|1gbit|...] [--name NAME]
                                          wb.Cluster(...).start()
  %wb status [--name NAME]                cluster.status()
  %wb scale --workers N [--name NAME]     cluster.scale(workers=N)
  %wb stop [--name NAME]                  cluster.stop()
  %wb shape [RATE] [--delay 0.2ms] [--between all|ps|worker:1|ps-worker] [--name NAME]
                                          cluster.shape(RATE, delay=..., between=...): set the emulated links
                                          (needs --network at start); `%wb shape off` clears them,
                                          `%wb shape` alone prints them
  %wb list                                every cluster this kernel runs, the default first
  %wb attach NAME                         wb.attach(NAME): use a cluster another kernel (or the panel) runs
  %%wb on worker:1 [--name NAME]          with cluster.device("worker:1"): <the cell>
  %%wb spmd [--name NAME] [--timeout S]   wb.run_spmd(cluster, <the cell>): on every worker at once, with
                                          `strategy` (MultiWorkerMirroredStrategy), `worker_index`, TF_CONFIG
  %wb train MODEL_FN DATA_FN [--loss LOSS] [--optimizer adam] [--learning-rate LR] [--metrics accuracy ...]
            [--strategy async-ps|sync-ps|allreduce] [--backup-workers K] [--transfer fp32|bf16|fp16|int8]
            [--steps-per-call C] [--steps N | --epochs E [--steps-per-epoch S]] [--batch-size B]
            [--validation-data DATA [--validation-steps V]] [--callbacks NAME]
            [--checkpoint DIR [--checkpoint-every N] [--resume]] [--seed S] [--wait] [--name NAME]
                                          wb.train(cluster, MODEL_FN, DATA_FN, strategy=wb.SyncPS(...), ...) -> a
                                          Job (also in `_wb_job`); loss, optimizer, metrics left out: the compiled
                                          model's; DATA, NAME: a data function or dataset, a list of Keras
                                          callbacks, defined in the notebook
  %wb placement [NAME]                    wb.placement(NAME, or the last job)
  %wb dashboard [--serve] [--name NAME]   wb.dashboard(cluster): live timeline, throughput and progress
                                          (--serve: wb.serve_dashboard(cluster), Bokeh apps with URLs)
  %wb profile [SECONDS] [--save PATH] [--name NAME]
                                          cluster.profile(seconds=2): an op-level trace of every task
                                          (--save: also a Chrome-trace JSON for Perfetto)
  %wb help                                this text

--name picks a cluster; without it, the last one started. Examples:
  %wb start --ps 1 --workers 2
  %%wb on worker:1
  x = tf.random.normal([2, 2])            # computed in the engine hosting worker:1
"""


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UsageError`` (shown as a one-line message) instead of exiting."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message}. Type %wb help for every subcommand with an example.")

    def exit(self, status: int = 0, message: str | None = None):
        raise UsageError(message or f"{self.prog}: see %wb help")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="%wb", add_help=False)
    commands = parser.add_subparsers(dest="command", parser_class=_Parser)
    start = commands.add_parser("start", prog="%wb start", add_help=False)
    start.add_argument("--ps", type=int, default=1)
    start.add_argument("--workers", type=int, default=2)
    start.add_argument("--engines", default="local")
    start.add_argument("--gpus-per-worker", type=int, default=0)
    start.add_argument("--network")
    start.add_argument("--name")
    for name in ("status", "stop"):
        commands.add_parser(name, prog=f"%wb {name}", add_help=False).add_argument("--name")
    scale = commands.add_parser("scale", prog="%wb scale", add_help=False)
    scale.add_argument("--workers", type=int, required=True)
    scale.add_argument("--name")
    shape = commands.add_parser("shape", prog="%wb shape", add_help=False)
    shape.add_argument("rate", nargs="?")
    shape.add_argument("--delay")
    shape.add_argument("--between", default="all")
    shape.add_argument("--name")
    commands.add_parser("list", prog="%wb list", add_help=False)
    commands.add_parser("attach", prog="%wb attach", add_help=False).add_argument("name")
    commands.add_parser("help", prog="%wb help", add_help=False)
    spmd = commands.add_parser("spmd", prog="%%wb spmd", add_help=False)
    spmd.add_argument("--name")
    spmd.add_argument("--timeout", type=float, default=600.0)
    on = commands.add_parser("on", prog="%%wb on", add_help=False)
    on.add_argument("task")
    on.add_argument("--name")
    train = commands.add_parser("train", prog="%wb train", add_help=False)
    train.add_argument("model")
    train.add_argument("data")
    train.add_argument("--loss")
    train.add_argument("--optimizer")
    train.add_argument("--learning-rate", type=float)
    train.add_argument("--strategy", default="async-ps")
    train.add_argument("--backup-workers", type=int)
    train.add_argument("--transfer")
    train.add_argument("--steps-per-call", type=int)
    train.add_argument("--steps", type=int)
    train.add_argument("--epochs", type=int)
    train.add_argument("--steps-per-epoch", type=int)
    train.add_argument("--validation-data")
    train.add_argument("--validation-steps", type=int)
    train.add_argument("--callbacks")
    train.add_argument("--checkpoint")
    train.add_argument("--checkpoint-every", type=int, default=0)
    train.add_argument("--resume", action="store_true")
    train.add_argument("--batch-size", type=int, default=64)
    train.add_argument("--metrics", nargs="*")
    train.add_argument("--seed", type=int)
    train.add_argument("--wait", action="store_true")
    train.add_argument("--name")
    placement = commands.add_parser("placement", prog="%wb placement", add_help=False)
    placement.add_argument("target", nargs="?")
    board = commands.add_parser("dashboard", prog="%wb dashboard", add_help=False)
    board.add_argument("--serve", action="store_true")
    board.add_argument("--name")
    profile = commands.add_parser("profile", prog="%wb profile", add_help=False)
    profile.add_argument("seconds", nargs="?", type=float, default=2.0)
    profile.add_argument("--save")
    profile.add_argument("--name")
    return parser


SUBCOMMANDS = ("start", "status", "scale", "stop", "shape", "list", "attach", "on", "spmd", "train", "placement", "dashboard", "profile",
               "help")
CELL_SUBCOMMANDS = ("on", "spmd")


@magics_class
class WorkbenchMagics(Magics):
    """The ``%wb`` line magic and ``%%wb`` cell magic."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self._parser = _parser()
        self._last_job = None

    # -- parsing and lookup ------------------------------------------------------------------

    def _parse(self, line: str) -> argparse.Namespace:
        try:
            words = shlex.split(line)
        except ValueError as exc:
            raise UsageError(f"%wb: cannot read the arguments ({exc}); check the quotes.") from None
        if not words:
            raise UsageError("%wb needs a subcommand: one of " + ", ".join(SUBCOMMANDS) + ". Type %wb help for examples.")
        if words[0] not in SUBCOMMANDS:
            raise UsageError(f"%wb: unknown subcommand {words[0]!r}: use one of {', '.join(SUBCOMMANDS)} (%wb help).")
        return self._parser.parse_args(words)

    @staticmethod
    def _cluster(name: str | None) -> Cluster:
        clusters = running_clusters()
        if not clusters:
            raise UsageError("no cluster is running in this kernel: start one with %wb start --ps 1 --workers 2.")
        if name is None:
            return clusters[-1]
        for cluster in clusters:
            if cluster.name == name:
                return cluster
        raise UsageError(f"no running cluster named {name!r}: this kernel runs {', '.join(c.name for c in clusters)}.")

    def _user_object(self, name: str, what: str, example: str | None = None) -> Any:
        if name not in self.shell.user_ns:
            raise UsageError(f"%wb train: {what} {name!r} is not defined in this notebook: define it first "
                             f"({example or f'def {name}(...): ...'}).")
        return self.shell.user_ns[name]

    # -- the magic -----------------------------------------------------------------------------

    @line_cell_magic
    def wb(self, line: str, cell: str | None = None):
        """Workbench clusters, placement and training; ``%wb help`` lists every subcommand."""
        args = self._parse(line)
        if (args.command in CELL_SUBCOMMANDS) != (cell is not None):
            raise UsageError("%%wb on TASK and %%wb spmd are cell magics (put them on the first line of a cell); "
                             "the other subcommands are line magics (%wb ...).")
        try:
            return getattr(self, f"_do_{args.command}")(args, cell)
        except WorkbenchError as exc:  # the API's own messages already say what to do
            raise UsageError(str(exc)) from None

    def _do_help(self, args, cell):
        print(HELP)

    def _do_start(self, args, cell):
        cluster = Cluster(ps=args.ps, workers=args.workers, engines=args.engines,
                          gpus_per_worker=args.gpus_per_worker, name=args.name, network=args.network).start()
        return cluster.status()

    def _do_shape(self, args, cell):
        cluster = self._cluster(args.name)
        if args.rate is None and args.delay is None:  # what is in force
            print(cluster.network or f"cluster {cluster.name!r} has no emulated links (%wb start --network auto)")
        elif args.rate in ("off", "none", "None"):
            print(cluster.shape(None))
        else:
            print(cluster.shape(args.rate, delay=args.delay, between=args.between))
        return None

    def _do_status(self, args, cell):
        return self._cluster(args.name).status()

    def _do_scale(self, args, cell):
        return self._cluster(args.name).scale(workers=args.workers).status()

    def _do_stop(self, args, cell):
        cluster = self._cluster(args.name)
        cluster.stop()
        return cluster.status()

    def _do_attach(self, args, cell):
        return Cluster.attach(args.name).status()

    def _do_list(self, args, cell):
        clusters = running_clusters()
        if not clusters:
            print("no cluster is running in this kernel (%wb start --ps 1 --workers 2)")
        for n, cluster in enumerate(reversed(clusters)):
            print(("* " if n == 0 else "  ") + repr(cluster))

    def _do_on(self, args, cell):
        cluster = self._cluster(args.name)
        try:
            TaskId.parse(args.task)
        except WorkbenchError as exc:
            raise UsageError(f"%%wb on: {exc}") from None
        with cluster.device(args.task):
            result = self.shell.run_cell(cell, store_history=False)
        if isinstance(result.error_in_exec, KeyboardInterrupt):
            # TensorFlow cannot cancel a remote op: the interrupt lands once the op in flight returns
            print(f"(interrupted on {args.task} of cluster {cluster.name!r} after its current op finished; the task is ready)")
        elif not result.success:
            # the cell's own traceback was shown above; say where it ran
            print(f"(the cell ran on {args.task} of cluster {cluster.name!r})")

    def _do_spmd(self, args, cell):
        outputs = training.run_spmd(self._cluster(args.name), cell, timeout=args.timeout)
        failed = []
        for output in outputs:
            print(f"[{output.task}]")
            text = (output.stdout + output.stderr).rstrip()
            if text:
                print(text)
            if output.error:
                print(output.error)
                failed.append(output.task)
        if failed:
            raise UsageError(f"the cell raised on {', '.join(failed)} (remote traceback above).")

    def _do_train(self, args, cell):
        cluster = self._cluster(args.name)
        model = self._user_object(args.model, "the model function")
        data = self._user_object(args.data, "the data function")
        fit = {"validation_data": self._user_object(args.validation_data, "the validation data") if args.validation_data else None,
               "callbacks": self._user_object(args.callbacks, "the callbacks", f"{args.callbacks} = [keras.callbacks.EarlyStopping()]")
               if args.callbacks else None}
        optimizer = args.optimizer
        if args.learning_rate is not None:  # a Keras optimizer config, built (and checked) by wb.train
            optimizer = {"class_name": args.optimizer or "adam", "config": {"learning_rate": args.learning_rate}}
        options = {name: value for name, value in (("backup_workers", args.backup_workers), ("transfer", args.transfer),
                                                   ("steps_per_call", args.steps_per_call)) if value is not None}
        if (args.checkpoint_every or args.resume) and not args.checkpoint:
            raise UsageError("%wb train: --checkpoint-every and --resume need --checkpoint DIR (where the checkpoints are).")
        checkpoint = (training.Checkpoint(args.checkpoint, every=args.checkpoint_every, resume=args.resume)
                      if args.checkpoint else None)
        try:
            job = training.train(cluster, model, data, args.loss, optimizer, metrics=args.metrics,
                                 strategy=training.strategy_named(args.strategy, **options), steps=args.steps,
                                 epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                                 validation_steps=args.validation_steps, checkpoint=checkpoint,
                                 batch_size=args.batch_size, seed=args.seed, **fit)
            self._last_job = job
            self.shell.user_ns["_wb_job"] = job
            if job.state == "queued":
                print(f"{job.describe()}: it begins when the cluster's running job ends (job.cancel() drops it).")
            if args.wait:
                job.wait()
        except KeyboardInterrupt as interrupt:  # the job goes on: one line, not a traceback
            print(f"Interrupted: {interrupt}")
            return None
        return job

    def _do_placement(self, args, cell):
        if args.target is None:
            if self._last_job is None:
                raise UsageError("%wb placement: no job yet; name a placed model, job or Keras model (%wb placement job).")
            return training.placement(self._last_job)
        return training.placement(self._user_object(args.target, "the object"))

    def _do_dashboard(self, args, cell):
        from .dashboard.live import dashboard  # (the package name is shadowed by wb.dashboard, the function)
        from .dashboard.server import serve_dashboard

        cluster = self._cluster(args.name)
        return serve_dashboard(cluster) if args.serve else dashboard(cluster)

    def _do_profile(self, args, cell):
        profile = self._cluster(args.name).profile(seconds=args.seconds)
        if args.save:
            print(f"Chrome trace written to {profile.save_chrome_trace(args.save)} (open it in https://ui.perfetto.dev)")
        return profile


def complete(line: str) -> list[str]:
    """Completions for the word being typed at the end of a ``%wb`` / ``%%wb`` line."""
    words = line.split()
    if line.endswith(" "):
        words.append("")
    words = words[1:]  # drop "%wb"
    if len(words) <= 1:
        return [c for c in SUBCOMMANDS if c.startswith(words[0] if words else "")]
    typed, previous = words[-1], words[-2]
    clusters = running_clusters()
    if previous == "--name":
        return [c.name for c in clusters if c.name.startswith(typed)]
    if words[0] == "on" and len(words) == 2 and clusters:
        names = words[words.index("--name") + 1] if "--name" in words[:-1] else None
        cluster = next((c for c in clusters if c.name == names), clusters[-1])
        return [r.name for r in cluster.tasks if r.name.startswith(typed)]
    return []


def load_ipython_extension(ipython) -> None:
    """``%load_ext workbench``: registers the magics and their tab completion."""
    ipython.register_magics(WorkbenchMagics)
    for prefix in ("%wb", "%%wb"):
        ipython.set_hook("complete_command", lambda _shell, event: complete(event.line), str_key=prefix)
