"""Job events as JSON between an attached process and the cluster's owner."""

import json

import pytest

from workbench.telemetry.events import JobProgress, StepDone, StepSpan, TaskEvent
from workbench.telemetry.wire import decode, encode


def test_job_events_travel_renamed_by_their_sender_and_come_back_equal():
    events = [JobProgress("async-ps-1", 1.0, 0, 50, "running", 1.0, "async-ps", ("worker:0", "worker:1")),
              StepSpan("worker:0", "/job:worker/replica:0/task:0/device:CPU:0", "compute", 1.0, 1.1, 0, 1, 32, "async-ps-1"),
              StepDone("async-ps-1", 0, 1.0, 1.1, 32, ("worker:0",), 2.3),
              TaskEvent("worker:1", "lost", 1.2, "its engine exited")]  # not a job's: the owner has its own
    back = decode(json.loads(json.dumps(encode(events, "pid 42"))))
    assert [type(e) for e in back] == [JobProgress, StepSpan, StepDone]
    assert {e.job for e in back} == {"async-ps-1 (pid 42)"}
    assert back[0].workers == ("worker:0", "worker:1") and back[2].loss == 2.3


@pytest.mark.parametrize("body, message", [
    ({"kind": "Nope"}, "unknown event"), ("text", "unknown event"), ({"kind": "StepDone", "job": "x"}, "StepDone with fields"),
])
def test_anything_else_is_refused_with_what_to_send(body, message):
    with pytest.raises(ValueError, match=message):
        decode([body])
    with pytest.raises(ValueError, match="a list of at most"):
        decode({"events": []})
