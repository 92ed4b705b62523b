"""The cost model's arithmetic (pure: wb.estimate's predict, on made-up profiles)."""

import pytest

import workbench as wb
from workbench.training.estimate import COMBINE, Profile, predict
from workbench.training.modelling.steps import UNROLL

MB = 1_000_000


def profile(strategy=None, overlap=True, ps=1, workers=2, step=0.010, parameter_bytes=4 * MB):
    return Profile(strategy or wb.AsyncPS(), 64, workers, ps, step, step / workers, parameter_bytes, parameter_bytes, overlap)


def joined(*bounds):
    return sum(b ** COMBINE for b in bounds) ** (1 / COMBINE)


def per_step(compute, push):
    """A worker's pass of UNROLL steps: each push overlaps the next step's compute, the last one's does not."""
    return (compute + (UNROLL - 1) * max(compute, push) + push) / UNROLL


def test_pushes_overlap_the_next_steps_compute_within_a_pass():
    assert UNROLL == 2  # the figures below are for two steps a pass
    # one worker, four ps tasks, a fast link: 10 ms compute, 4 MB at 10 Gbit/s = 3.2 ms each way
    seconds, bottleneck = predict(profile(ps=4, workers=1), 10e9, workers=1)
    assert bottleneck == "the workers' steps"
    assert seconds == pytest.approx(joined((0.010 + 0.010 + 0.0032) / 2, 0.0008))  # 11.6 ms: one push in two shows


def test_a_slow_link_makes_the_ps_card_the_bottleneck():
    seconds, bottleneck = predict(profile(), 1e9)  # 4 MB each way at 125 MB/s: 32 ms per step through the ps
    assert bottleneck.startswith("the ps's link")
    assert seconds == pytest.approx(joined(0.032, per_step(0.010, 0.032) / 2))  # the workers' 18.5 ms add a little
    alone, _ = predict(profile(step=0.001, workers=8), 1e8)  # the workers far below the link: the link, nearly
    assert alone == pytest.approx(4 * MB / 12.5e6, rel=0.01)


def test_equal_bounds_join_rather_than_take_turns():
    # 2 workers, 4 MB at 1 Gbit/s: each direction 32 ms; a 48 ms compute: (48 + 48 + 32) / 2 = 64 ms a step per
    # worker, 32 for both: the same as the link's 32
    seconds, _ = predict(profile(step=0.048), 1e9)
    assert seconds == pytest.approx(0.032 * 2 ** (1 / COMBINE))


def test_a_fast_link_leaves_the_workers_as_the_limit():
    seconds, bottleneck = predict(profile(parameter_bytes=10_000), 10e9)
    assert bottleneck == "the workers' steps"
    assert seconds == pytest.approx(per_step(0.010, 10_000 / 1.25e9) / 2, rel=1e-6)


def test_overlap_hides_the_read():
    link = 10e9  # 4 MB: 3.2 ms each way; one worker and four ps tasks: the worker's own steps limit
    serial, _ = predict(profile(overlap=False, ps=4), link, workers=1)
    overlapped, _ = predict(profile(overlap=True, ps=4), link, workers=1)
    assert serial == pytest.approx(joined(per_step(0.010, 3.2e-3) + 3.2e-3, 0.8e-3))
    assert overlapped == pytest.approx(joined(per_step(0.010, 3.2e-3), 0.8e-3))
    assert overlapped < serial


def test_more_ps_tasks_share_the_bytes():
    one, _ = predict(profile(workers=4), 1e9)  # four workers: the ps's card limits, not the workers' own
    two, bottleneck = predict(profile(workers=4, ps=2), 1e9)
    assert bottleneck.startswith("the ps's link")
    workers = per_step(0.010, 0.032) / 4
    assert (one, two) == (pytest.approx(joined(0.032, workers)), pytest.approx(joined(0.016, workers)))


def test_sync_ps_pays_every_workers_transfers_through_the_ps():
    seconds, bottleneck = predict(profile(strategy=wb.SyncPS()), 1e9, workers=4)
    assert seconds == pytest.approx(0.005 + 4 * 2 * 4 * MB / 125e6)
    assert bottleneck == "the ps's link"


def test_seconds_for_a_number_of_steps_adds_the_profiles_set_up():
    measured = Profile(wb.AsyncPS(), 64, 2, 1, 0.010, 0.005, 4 * MB, 4 * MB, False, setup_seconds=2.5)
    estimate = wb.estimate(None, None, 64, link="10gbit", profile=measured)
    assert estimate.seconds_for(400) == pytest.approx(2.5 + 400 * estimate.step_seconds)
    assert estimate.seconds_for(400) - estimate.seconds_for(200) == pytest.approx(200 / estimate.steps_per_s)
    assert str(estimate).endswith("; a job's set-up 2.5 s (seconds_for(steps) adds it)")
    for wrong in (0, True, 2.5):
        with pytest.raises(wb.ConfigurationError, match="pass a whole number of global steps"):
            estimate.seconds_for(wrong)


def test_a_profile_serves_the_epochs_it_ran():
    measured = Profile(wb.AsyncPS(), 64, 2, 1, 0.010, 0.005, 4 * MB, 4 * MB, False, setup_seconds=2.5, steps_per_epoch=20)
    assert wb.estimate(None, None, 64, profile=measured, steps_per_epoch=20).profile is measured
    with pytest.raises(wb.ConfigurationError, match="steps_per_epoch=50: profile= ran epochs of 20 steps"):
        wb.estimate(None, None, 64, profile=measured, steps_per_epoch=50)
    with pytest.raises(wb.ConfigurationError, match="steps_per_epoch=0: pass a whole number of steps >= 1"):
        wb.estimate(None, None, 64, profile=measured, steps_per_epoch=0)


def test_the_jobs_own_data_comes_with_its_loss_for_a_new_profile():
    def data(ctx):
        return ctx

    with pytest.raises(wb.ConfigurationError, match="loss= is missing: .* pass both"):
        wb.estimate(None, None, 64, data=data)
    with pytest.raises(wb.ConfigurationError, match="data= is missing"):
        wb.estimate(None, None, 64, loss="mse")
    with pytest.raises(wb.ConfigurationError, match=r"data=3: pass the job's data function, data\(ctx\)"):
        wb.estimate(None, None, 64, data=3, loss="mse")
    measured = Profile(wb.AsyncPS(), 64, 2, 1, 0.010, 0.005, 4 * MB, 4 * MB, False, setup_seconds=2.5)
    with pytest.raises(wb.ConfigurationError, match="profile= was measured already"):
        wb.estimate(None, None, 64, profile=measured, data=data, loss="mse")
