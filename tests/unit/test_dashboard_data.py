"""Events -> plot data, the ring buffer's rollover, the recorder and the components' streaming."""

import math

import pytest

from workbench.cluster.status import TaskRecord
from workbench.dashboard.components import ProgressComponent, ThroughputComponent
from workbench.dashboard.data import (
    TOTAL,
    JobState,
    ThroughputBins,
    current_rates,
    device_rows,
    progress_info,
    row_name,
    span_columns,
)
from workbench.dashboard.summary import JobSummary
from workbench.dashboard.timeline import TimelineComponent
from workbench.telemetry import EventLog, StepSpan
from workbench.telemetry.clocks import offset_from
from workbench.telemetry.events import COMPUTE, PUSH_APPLY, RUNNING, JobProgress, StepDone
from workbench.telemetry.recorder import StepRecorder

W0 = "/job:worker/replica:0/task:0/device:CPU:0"


def span(step, start, end, task="worker:0", device=W0, phase=COMPUTE, examples=32, key=""):
    return StepSpan(task, device, phase, start, end, step, 1, examples, "j", key)


def test_event_log_keeps_the_newest_and_tells_readers_what_they_missed():
    log = EventLog(capacity=5)
    log.extend(span(i, i, i + 1) for i in range(8))
    batch = log.since(0)
    assert [e.step for e in batch.events] == [3, 4, 5, 6, 7]
    assert (batch.cursor, batch.missed) == (8, 3)
    assert [e.step for e in log.since(6).events] == [6, 7]
    assert [e.step for e in log.since(4, limit=2).events] == [4, 5]
    assert log.since(8).events == [] and log.since(8).cursor == 8
    with pytest.raises(ValueError, match="at least one"):
        EventLog(0)


def test_in_progress_span_is_replaced_by_the_span_that_completes_it():
    log = EventLog()
    log.append(span(0, 1.0, None, phase=RUNNING, key="k"))
    assert [s.key for s in log.in_progress()] == ["k"] and log.cursor == 0
    log.append(span(0, 1.0, 2.0, key="k"))
    assert log.in_progress() == [] and log.cursor == 1
    log.append(span(1, 3.0, None, phase=RUNNING, key="gone"))
    log.close("gone")
    assert log.in_progress() == []


def test_recorder_splits_each_step_at_its_gradient_mark_and_shifts_clocks():
    log = EventLog()
    recorder = StepRecorder(log, "j", {"worker:0": 10.0})
    key = recorder.call_started("worker:0", W0, 5, 2)
    assert log.in_progress()[0].phase == RUNNING
    recorder.steps("worker:0", W0, 5, [110.0, 110.5, 111.0], [110.2, 110.9], 32, PUSH_APPLY, key)
    spans = log.since(0).events
    assert [(s.phase, s.step, s.start, s.end) for s in spans] == [
        (COMPUTE, 5, 100.0, pytest.approx(100.2)), (PUSH_APPLY, 5, pytest.approx(100.2), 100.5),
        (COMPUTE, 6, 100.5, pytest.approx(100.9)), (PUSH_APPLY, 6, pytest.approx(100.9), 101.0)]
    assert [s.examples for s in spans] == [32, 0, 32, 0]
    assert log.in_progress() == []  # the last span completed the call's bar
    recorder.step_done({"step": 5, "start": 110.0, "end": 110.5, "examples": 32, "worker": "worker:0", "loss": 1.0})
    assert log.since(4).events[0].end == 100.5
    StepRecorder(None, "off").steps("worker:0", W0, 0, [1, 2], None, 1, PUSH_APPLY)  # telemetry off: a no-op


def test_clock_offset_uses_the_tightest_round_trip():
    assert offset_from([(0.0, 10.5, 1.0), (2.0, 12.05, 2.1), (3.0, 14.0, 5.0)]) == pytest.approx(10.0)


def test_span_columns_draw_in_progress_spans_up_to_now_in_milliseconds():
    columns = span_columns([span(0, 1.0, 1.5), span(1, 2.0, None, phase=RUNNING)], now=3.0)
    assert columns["left"] == [1000.0, 2000.0] and columns["right"] == [1500.0, 3000.0]
    assert columns["duration_ms"] == [500.0, 1000.0]
    assert columns["row"] == [row_name(W0)] * 2 == ["/job:worker/task:0/device:CPU:0"] * 2


def test_device_rows_list_every_cpu_and_gpu_ps_first():
    tasks = [TaskRecord("ps", 0, 0, "h"), TaskRecord("worker", 0, 1, "h", devices=[
        W0, "/job:worker/replica:0/task:0/device:GPU:0", "/job:worker/replica:0/task:0/device:GPU:1"])]
    assert device_rows(tasks) == ["/job:ps/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0",
                                  "/job:worker/task:0/device:GPU:0", "/job:worker/task:0/device:GPU:1"]


def test_throughput_bins_count_per_worker_and_total_and_update_late_bins():
    bins = ThroughputBins(width=1.0, settle=0.5)
    bins.add([span(0, 10.0, 10.2), span(1, 10.2, 10.4, task="worker:1"), StepDone("j", 0, 10.0, 10.4, 64, ("worker:0",))])
    assert bins.final(11.0) == []  # bin 10 ends at 11 and settles at 11.5
    rows = bins.final(11.6)
    assert rows == [{"time": 10000.0, "total:examples": 64.0, "total:steps": 1.0, "worker:0:examples": 32.0,
                     "worker:0:steps": 1.0, "worker:1:examples": 32.0, "worker:1:steps": 1.0}]
    bins.add([StepDone("j", 1, 10.5, 10.9, 64, ("worker:0",))])  # a late result for a drawn bin
    assert bins.take_changed() == [10] and bins.row(10)["total:steps"] == 2.0
    later = bins.final(13.6)  # job j has not ended: nothing landed is a zero
    assert [r["time"] for r in later] == [11000.0, 12000.0] and [r["total:steps"] for r in later] == [0.0, 0.0]


def test_throughput_is_zero_only_while_a_job_runs_and_a_worker_had_begun():
    bins = ThroughputBins(width=1.0, settle=0.0)
    bins.add([JobProgress("a", 10.0, 0, 9, "running", 10.0, "async-ps", ("worker:0",)), span(0, 10.0, 10.2),
              StepDone("a", 0, 10.0, 10.2, 32, ("worker:0",)), span(1, 12.0, 12.2),
              StepDone("a", 1, 12.0, 12.2, 32, ("worker:0",)), JobProgress("a", 13.1, 2, 2, "finished", 10.0)])
    bins.add([JobProgress("b", 13.2, 0, 9, "running", 13.2, "async-ps", ("worker:1",)),  # set up until 15
              span(0, 15.0, 15.2, task="worker:1"), StepDone("b", 0, 15.0, 15.2, 32, ("worker:1",))])
    rows = {r["time"] / 1000: r for r in bins.final(17.0)}
    assert rows[11]["total:steps"] == 0.0 and rows[11]["worker:0:steps"] == 0.0  # job a trained, nothing landed
    # job a's wrap-up after its last step, then job b's set-up: a break, not a fall to zero
    assert all(math.isnan(rows[t]["total:steps"]) for t in (13, 14)) and math.isnan(rows[13]["worker:0:steps"])
    assert math.isnan(rows[12]["worker:1:steps"]) and rows[15]["worker:1:steps"] == 1.0  # before it joined: a gap
    assert rows[12]["total:steps"] == 1.0
    assert math.isnan(rows[16]["worker:0:steps"]) and rows[16]["worker:1:steps"] == 0.0  # not in job b: a gap
    rates = current_rates([(9.5, TOTAL, 64), (10.5, TOTAL, 64), (10.9, "worker:0", 32)], now=11.0, window=1.0)
    assert rates == {TOTAL: (64.0, 1.0), "worker:0": (32.0, 1.0)}


def test_a_failed_job_counts_as_training_until_it_failed_a_finished_one_until_its_last_step():
    bins = ThroughputBins(width=1.0, settle=0.0)
    bins.add([JobProgress("a", 10.0, 0, 1, "running", 10.0, "sync-ps", ("worker:0",)),
              StepDone("a", 0, 10.0, 10.2, 32, ("worker:0",)), JobProgress("a", 11.6, 1, 1, "finished", 10.0)])
    bins.add([JobProgress("b", 20.0, 0, 9, "running", 20.0, "sync-ps", ("worker:0",)),
              StepDone("b", 0, 20.0, 20.2, 32, ("worker:0",)), JobProgress("b", 22.5, 1, 9, "failed", 20.0)])
    rows = {r["time"] / 1000: r for r in bins.final(24.0)}
    assert rows[10]["total:steps"] == 1.0 and math.isnan(rows[11]["total:steps"])  # a's wrap-up: no training
    assert rows[21]["total:steps"] == 0.0 and rows[22]["total:steps"] == 0.0  # b stalled until it failed: zeros
    assert math.isnan(rows[23]["total:steps"])


def test_progress_notes_slow_steps_and_stale_workers():
    job = JobState("j")
    job.add(JobProgress("j", 0.0, 0, 100, "running", 0.0, "async-ps", ("worker:0", "worker:1")))
    for i in range(20):  # worker:0 steps once a second; worker:1 never
        job.add(span(i, i, i + 0.05))
        job.add(StepDone("j", i, i, i + 0.05, 32, ("worker:0",)))
    stuck = StepSpan("worker:1", "/job:worker/replica:0/task:1/device:CPU:0", RUNNING, 1.0, None, 20, 5, job="j", key="k")
    info = progress_info(job, [stuck], now=20.0, rate=10.0)
    assert info["steps_done"] == 20 and info["eta_s"] == pytest.approx(8.0)
    assert len(info["notes"]) == 1 and "worker:1 has been running steps 20-24 for 19.0 s" in info["notes"][0]
    info = progress_info(job, [], now=20.0, rate=10.0)  # no bar running either: stale
    assert len(info["notes"]) == 1 and "worker:1 reported no step" in info["notes"][0]
    assert progress_info(job, [], now=4.0, rate=10.0)["notes"] == []  # too early to call it stale


def test_an_ended_job_keeps_its_average_rates_and_its_elapsed_time():
    job = JobState("j")
    job.add(JobProgress("j", 100.0, 0, 10, "running", 100.0, "sync-ps", ("worker:0",)))
    for i in range(10):  # 10 steps of 64 examples from 101.0 to 103.0
        job.add(StepDone("j", i, 101.0 + 0.2 * i, 101.2 + 0.2 * i, 64, ("worker:0",)))
    running = progress_info(job, [], now=103.5, rate=5.0)
    assert running["elapsed_s"] == pytest.approx(3.5) and running["average_examples_per_s"] == pytest.approx(320.0)
    job.add(JobProgress("j", 103.1, 10, 10, "finished", 100.0, "sync-ps", ("worker:0",)))
    for now in (104.0, 110.0):  # frozen once it ended, however long after
        info = progress_info(job, [], now=now, rate=0.0)
        assert info["elapsed_s"] == pytest.approx(3.1) and info["average_steps_per_s"] == pytest.approx(5.0)


def test_the_summary_of_an_ended_job_gives_its_average_not_the_silence_after_it():
    log = EventLog()
    log.append(JobProgress("j", 100.0, 0, 4, "running", 100.0, "async-ps", ("worker:0",)))
    log.extend(StepDone("j", i, 100.0 + i, 101.0 + i, 32, ("worker:0",)) for i in range(4))
    log.append(JobProgress("j", 104.2, 4, 4, "finished", 100.0, "async-ps", ("worker:0",)))
    summary = JobSummary(log)
    info = summary.update(now=120.0)  # 16 s after its last step: nothing in the rate window
    assert info["state"] == "finished" and info["examples_per_s"] == pytest.approx(32.0)
    assert info["steps_per_s"] == pytest.approx(1.0) and info["elapsed_s"] == pytest.approx(4.2)
    assert info["workers"] == {}


def test_components_stream_only_new_rows_with_rollover():
    log = EventLog()
    timeline = TimelineComponent(log, [row_name(W0)], rollover=4, segment_rows=2)
    log.extend(span(i, i, i + 0.5) for i in range(3))
    assert timeline.update(now=10.0) == 3
    assert timeline.update(now=10.0) == 0  # nothing new: nothing streamed
    assert timeline.columns()["step"] == [0, 1, 2] and len(timeline.segments) == 2
    log.extend(span(i, i, i + 0.5) for i in range(3, 8))
    timeline.update(now=10.0)
    assert timeline.columns()["step"] == [2, 3, 4, 5, 6, 7]  # whole segments of 2 roll out past 4 rows
    assert [len(s.data["step"]) for s in timeline.sources[:-1]] == [2, 2, 2]
    segment_renderers = [r for r in timeline.plot.renderers if r.data_source.name.startswith("timeline_steps")]
    assert [r.data_source for r in segment_renderers] == timeline.sources[:-1]  # rolled-out ones left the plot
    log.append(span(9, 9.0, None, task="worker:1", device="/job:worker/replica:0/task:1/device:CPU:0",
                    phase=RUNNING, key="k"))
    timeline.update(now=12.0)
    assert timeline.open_source.data["right"] == [12000.0]
    assert "/job:worker/task:1/device:CPU:0" in timeline.plot.y_range.factors  # a new task gets its row

    throughput = ThroughputComponent(log)
    log.append(StepDone("j", 0, 1.0, 1.2, 64, ("worker:0",)))
    throughput.update(now=5.0)
    times = throughput.source.data["time"]
    assert times[0] == 0.0 and len(times) == len(set(times))
    assert math.isclose(sum(v for v in throughput.source.data["total:steps"] if not math.isnan(v)), 1.0)
    progress = ProgressComponent(log)
    progress.update(now=5.0)
    assert "No job yet" in progress.root.text  # no JobProgress: nothing to show


def test_timeline_draws_only_the_segments_in_view():
    log = EventLog()
    timeline = TimelineComponent(log, [row_name(W0)], rollover=100, segment_rows=10)
    log.extend(span(i, 1000.0 + i, 1000.5 + i) for i in range(100))  # 10 segments, one per 10 s
    timeline.update(now=1100.0)
    visible = [r.visible for _, r in timeline.segments]
    assert visible[-4:] == [True] * 4 and not any(visible[:5])  # following: about the last 30 s
    timeline.plot.x_range.start, timeline.plot.x_range.end = 1_012_000.0, 1_018_000.0  # the user panned back
    timeline.update(now=1100.0)
    visible = [r.visible for _, r in timeline.segments]
    assert visible[1] and not visible[5] and visible[-1]  # that segment, and the newest (still streaming)


def test_task_health_events_become_markers_on_their_tasks_rows():
    from workbench.dashboard.data import FAULT_COLOURS, fault_columns, task_row
    from workbench.telemetry.events import TaskEvent

    rows = [row_name("/job:ps/replica:0/task:0/device:CPU:0"), row_name(W0),
            row_name("/job:worker/replica:0/task:1/device:GPU:0"), row_name("/job:worker/replica:0/task:1/device:CPU:0")]
    assert task_row("worker:1", rows) == "/job:worker/task:1/device:GPU:0"  # its first row
    assert task_row("worker:7", rows) is None
    events = [TaskEvent("worker:1", "lost", 5.0, "its engine exited"), TaskEvent("worker:1", "recovering", 5.5),
              TaskEvent("worker:1", "running", 7.0, "re-hosted on engine 3"),
              TaskEvent("ps:0", "restored", 8.0, "resumed from step 100", job="async-ps-1"),
              TaskEvent("worker:9", "lost", 9.0),  # a task the timeline does not show
              TaskEvent("controller", "controller-lost", 9.5)]  # not a task row: the notebook says it
    columns = fault_columns([*events, span(0, 1.0, 2.0)], rows)
    assert columns["kind"] == ["lost", "recovering", "running", "restored"]
    assert columns["x"] == [5000.0, 5500.0, 7000.0, 8000.0]
    assert columns["row"][:3] == ["/job:worker/task:1/device:GPU:0"] * 3 and columns["row"][3].startswith("/job:ps/task:0/")
    assert columns["colour"] == [FAULT_COLOURS[k] for k in columns["kind"]] and columns["job"][3] == "async-ps-1"

    log = EventLog()
    timeline = TimelineComponent(log, rows)
    log.extend(events)
    log.append(span(0, 1.0, 2.0))
    assert timeline.update(now=10.0) == 1
    assert timeline.fault_source.data["kind"] == ["lost", "recovering", "running", "restored"]
    assert timeline.update(now=10.0) == 0 and len(timeline.fault_source.data["kind"]) == 4  # streamed once


def test_reshaped_links_shade_the_timeline_until_they_change_again():
    from workbench.telemetry.events import LinkEvent

    log = EventLog()
    timeline = TimelineComponent(log, [row_name(W0)])
    log.extend([LinkEvent(1000.0, "all: 1 Gbit/s"), LinkEvent(1010.0, "worker:1: 100 Mbit/s"),
                LinkEvent(1020.0, "unshaped")])
    timeline.update(now=1030.0)
    bands = [(b.left, b.right) for b in timeline.link_bands]
    assert bands == [(1_000_000.0, 1_010_000.0), (1_010_000.0, 1_020_000.0)]
    labels = [m.text for m in timeline.plot.center if getattr(m, "name", "") == "timeline_links_label"]
    assert labels == ["links: all: 1 Gbit/s", "links: worker:1: 100 Mbit/s"]


def test_progress_shows_the_bytes_a_step_moves_and_their_precision():
    log = EventLog()
    progress = ProgressComponent(log)
    log.append(JobProgress("async-ps-1", 100.0, 0, 50, RUNNING, 100.0, "async-ps", ("worker:0",), "bf16", 19_240))
    progress.update(now=101.0)
    assert "19.2 kB/step (bf16)" in progress.root.text


def test_a_queued_job_shows_under_the_running_one_until_it_begins():
    log = EventLog()
    progress = ProgressComponent(log)
    log.append(JobProgress("async-ps-1", 100.0, 0, 50, RUNNING, 100.0, "async-ps", ("worker:0",)))
    log.append(JobProgress("sync-ps-2", 101.0, 0, 80, "queued", 101.0, "sync-ps", ("worker:0",)))
    info = progress.summary.update(now=102.0)
    assert info["job"] == "async-ps-1" and info["queued"] == ["job sync-ps-2 (sync-ps, 80 steps)"]
    progress.update(now=102.0)
    assert "queued: job sync-ps-2 (sync-ps, 80 steps)" in progress.root.text
    log.append(JobProgress("async-ps-1", 103.0, 50, 50, "finished", 100.0, "async-ps", ("worker:0",)))
    log.append(JobProgress("sync-ps-2", 103.5, 0, 80, RUNNING, 103.5, "sync-ps", ("worker:0",)))
    info = progress.summary.update(now=104.0)
    assert info["job"] == "sync-ps-2" and info["state"] == RUNNING and info["queued"] == []


def test_the_summary_catches_up_with_a_long_log_and_a_job_cancelled_in_the_queue_never_shows():
    from workbench.dashboard.summary import JobSummary

    log = EventLog()
    for n in range(5):  # older jobs: more events than one read takes
        log.append(JobProgress(f"async-ps-{n}", 100.0 + n, 0, 50, RUNNING, 100.0 + n, "async-ps", ("worker:0",)))
        log.extend([StepDone(f"async-ps-{n}", step, 100.0 + n, 100.01 + n, 32, ("worker:0",)) for step in range(50)])
        log.append(JobProgress(f"async-ps-{n}", 101.0 + n, 50, 50, "finished", 100.0 + n, "async-ps", ("worker:0",)))
    log.append(JobProgress("sync-ps-9", 110.0, 0, 80, "queued", 110.0, "sync-ps", ("worker:0",)))
    log.append(JobProgress("sync-ps-9", 111.0, 0, 80, "cancelled", 110.0, "sync-ps", ("worker:0",)))
    info = JobSummary(log, events_per_update=10).update(now=112.0)
    assert info["job"] == "async-ps-4" and info["steps_done"] == 50 and info["state"] == "finished"


def test_time_axes_read_as_clock_time_and_short_throughput_runs_show_their_points():
    from bokeh.models import Scatter

    log = EventLog()
    timeline, throughput = TimelineComponent(log, ["worker:0"]), ThroughputComponent(log)
    for plot in (timeline.plot, throughput.examples_plot, throughput.steps_plot):
        assert plot.xaxis[0].formatter.milliseconds == "%H:%M:%S.%3N"  # not Bokeh's bare "0ms ... 800ms"
    assert any(isinstance(r.glyph, Scatter) for r in throughput.examples_plot.renderers)


def test_the_timeline_zoomed_out_draws_an_overview_and_zoomed_in_every_bar(monkeypatch):
    from workbench.dashboard import timeline as timeline_module
    from workbench.dashboard.data import overview_columns

    columns = {"row": ["a", "a", "a", "b"], "left": [0.0, 1.0, 50.0, 0.0], "right": [0.5, 1.5, 50.5, 5.0],
               "phase": ["compute", "push+apply", "compute", "apply"]}
    drawn = overview_columns(columns, 0.0, 100.0, 10.0)
    assert list(zip(drawn["row"], drawn["left"], drawn["phase"], drawn["bars"])) == [
        ("a", 0.0, "compute", 2), ("a", 50.0, "compute", 1), ("b", 0.0, "apply", 1)]
    assert drawn["alpha"] == [0.2, 0.2, 0.5] and drawn["busy_ms"] == [1.0, 0.5, 5.0]  # busy share, at least 0.2
    straggler = overview_columns({**columns, "right": [0.5, 1.5, 50.5, 35.0]}, 0.0, 100.0, 10.0)  # b: 35 ms long
    assert ("b", 0.0, 35.0, 1.0) in list(zip(straggler["row"], straggler["left"], straggler["right"], straggler["alpha"]))

    log = EventLog()
    log.extend(span(i, 100.0 + i * 0.01, 100.0 + i * 0.01 + 0.002) for i in range(3000))  # 2 ms steps over 30 s
    timeline = TimelineComponent(log, [row_name(W0)])
    timeline.update(now=130.5)  # drawn nowhere yet: every bar, no overview computed
    assert not timeline.overview.visible and not timeline.overview_source.data["left"]
    monkeypatch.setattr(timeline_module, "_drawn_width", lambda plot: 1000)  # as a browser 1000 px wide reports
    timeline.update(now=131.0)  # following the newest 30 s on 1000 px: 30 ms a pixel, bars of 2 ms
    assert timeline.overview.visible and not any(r.visible for _, r in timeline.segments)
    assert 300 < len(timeline.overview_source.data["left"]) <= 1100 and sum(timeline.overview_source.data["bars"]) == 3000
    timeline.plot.x_range.start, timeline.plot.x_range.end = 110_000.0, 110_500.0  # zoomed in on 0.5 s: 0.5 ms a pixel
    timeline.update(now=131.5)
    assert not timeline.overview.visible and timeline.segments[-1][1].visible


def test_the_live_widget_applies_the_browsers_events_and_drops_one_it_cannot_apply_without_raising(caplog):
    # a browser event for a model the kernel dropped since (a rolled-out timeline segment): raised, ipywidgets
    # would hand it to IPython's showtraceback from the kernel's comm handler
    import threading

    from bokeh.plotting import figure

    from workbench.compat.jupyter_bokeh import live_widget_class

    plot = figure(width=200, height=200)
    plot.line([1, 2], [3, 4])
    widget = live_widget_class(threading.RLock())(plot)
    changed = {"event": "jsevent", "kind": "ModelChanged", "attr": "start", "new": 1.5}
    gone = "p-dropped-by-the-kernel"
    with caplog.at_level("DEBUG", logger="workbench.dashboard"):
        widget._handle_custom_msg({**changed, "model": {"id": gone}}, [])
        widget._handle_custom_msg({**changed, "model": {"id": plot.x_range.id}}, [])
    assert widget.dropped_events == 1
    assert plot.x_range.start == 1.5  # the next event still applies
    (line,) = [r.getMessage() for r in caplog.records if r.name == "workbench.dashboard"]
    assert "ModelChanged" in line and gone in line, line
