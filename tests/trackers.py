"""Experiment trackers as the tests use them: a real MLflow tracking server on loopback, W&B's offline run files."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

MLFLOW_START_TIMEOUT = 90.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 with its own SQLite store and artifact folder under ``base``."""

    def __init__(self, base: Path):
        self.base, self.port = base, _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        command = [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{base / 'mlflow.db'}",
                   "--artifacts-destination", str(base / "artifacts")]
        # no server-side job runner: its consumers polled through the whole session (1.5 CPU-minutes of the suite)
        env = {**os.environ, "MLFLOW_HOME": str(base), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(base / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, cwd=base, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + MLFLOW_START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"mlflow server exited: {(self.base / 'server.log').read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"mlflow server did not answer in {MLFLOW_START_TIMEOUT} s: "
                             f"{(self.base / 'server.log').read_text()[-2000:]}")

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and its uvicorn worker: our own group
            self.process.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(15)
        self.log.close()


BLOCK = 32768  # W&B's run file: LevelDB's log format, in 32 KiB blocks, after a 7-byte header


def wandb_records(path: Path):
    """Every record of an offline W&B run file (``run-<id>.wandb``), as W&B's own protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, parts = 7, b""
    while position + 7 <= len(data):
        left = BLOCK - position % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if length == 0 and kind == 0:
            position += left
            continue
        parts += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_run(run_dir: Path) -> dict:
    """An offline run's config (key -> value), history rows and files: ``{"config", "history", "files"}``."""
    (path,) = Path(run_dir).glob("run-*.wandb")
    config, history = {}, []
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):  # the config given to wandb.init comes in the run record
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    files = sorted(str(p.relative_to(run_dir / "files")) for p in (run_dir / "files").rglob("*") if p.is_file())
    return {"config": config, "history": history, "files": files}
