"""``%wb`` and ``%%wb``: notebook magics, a thin layer over the Python API (no logic of their own).

    %load_ext workbench
    %wb start --ps 1 --workers 2        %wb status | scale --workers 4 | stop | list | help
    %%wb on worker:1                    (the cell's ops run on that task; its variables live there)
    %wb train make_model make_data --loss sparse_categorical_crossentropy --strategy sync-ps --steps 500
    %wb placement [name]
    %wb dashboard [--job [NAME]] [--serve]   %wb profile 2 [--save trace.json]

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
from .errors import ConfigurationError, WorkbenchError, described
from .magic_args import CELL_SUBCOMMANDS, SUBCOMMANDS, help_text, launcher_options, parser
from .training.fit.loop import check_callbacks


@magics_class
class WorkbenchMagics(Magics):
    """The ``%wb`` line magic and ``%%wb`` cell magic."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self._parser = parser()
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
        except WorkbenchError as exc:  # the API's own messages already say what to do, and link their help
            raise UsageError(described(exc)) from None

    def _do_help(self, args, cell):
        print(help_text())

    def _do_start(self, args, cell):
        options = {key: value for key in ("queue", "account", "timelimit") if (value := getattr(args, key)) is not None}
        cluster = Cluster(ps=args.ps, workers=args.workers, engines=args.engines, gpus_per_worker=args.gpus_per_worker,
                          name=args.name, network=args.network, controller_ip=args.controller_ip,
                          **options, **launcher_options(args.option)).start()
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

    @staticmethod
    def _tracker(name: str):
        from . import tracking

        try:
            return tracking.callback_for(name)
        except ConfigurationError as exc:
            raise UsageError(f"%wb train --tracking {name}: {exc}") from None

    def _do_train(self, args, cell):
        cluster = self._cluster(args.name)
        model = self._user_object(args.model, "the model function")
        data = self._user_object(args.data, "the data function")
        fit = {"validation_data": self._user_object(args.validation_data, "the validation data") if args.validation_data else None,
               "callbacks": self._user_object(args.callbacks, "the callbacks", f"{args.callbacks} = [keras.callbacks.EarlyStopping()]")
               if args.callbacks else None}
        if args.tracking:
            fit["callbacks"] = [*check_callbacks(fit["callbacks"]), self._tracker(args.tracking)]
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

        if args.job is not None:
            if args.serve:
                raise UsageError("%wb dashboard: --serve serves the cluster's plots; --job shows one job in the notebook.")
            return dashboard(self._job(args.job))
        cluster = self._cluster(args.name)
        return serve_dashboard(cluster) if args.serve else dashboard(cluster)

    def _job(self, name: str):
        """The job named (one of this kernel's, on any of its clusters), or the last one ``%wb train`` started."""
        if not name:
            if self._last_job is None:
                raise UsageError("%wb dashboard --job: no job yet; start one with %wb train, or name one (--job async-ps-1).")
            return self._last_job
        for cluster in running_clusters():
            try:
                return cluster.jobs[name]
            except KeyError:
                continue
        raise UsageError(f"%wb dashboard --job {name}: no job of that name on this kernel's clusters "
                         "(cluster.jobs lists them).")

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
