"""The cost model's arithmetic (pure: wb.estimate's predict, on made-up profiles)."""

import pytest

from workbench.training.estimate import Profile, predict

MB = 1_000_000


def profile(strategy="async-ps", overlap=True, ps=1, workers=2, step=0.010, parameter_bytes=4 * MB):
    return Profile(strategy, "fp32", 64, workers, ps, step, step / workers, parameter_bytes, parameter_bytes, overlap)


def test_a_slow_link_makes_the_ps_card_the_bottleneck():
    seconds, bottleneck = predict(profile(), 1e9)  # 4 MB each way at 125 MB/s: 32 ms per step through the ps
    assert bottleneck.startswith("the ps's link")
    assert seconds == pytest.approx(4 * MB / 125e6)


def test_a_fast_link_leaves_the_workers_as_the_limit():
    seconds, bottleneck = predict(profile(parameter_bytes=10_000), 10e9)
    assert bottleneck == "the workers' steps"
    assert seconds == pytest.approx((0.010 + 10_000 / 1.25e9) / 2)


def test_overlap_hides_the_shorter_of_compute_plus_push_and_read():
    link = 10e9  # 4 MB: 3.2 ms each way; one worker and four ps tasks: the worker's own steps limit
    serial, _ = predict(profile(overlap=False, ps=4), link, workers=1)
    overlapped, _ = predict(profile(overlap=True, ps=4), link, workers=1)
    assert serial == pytest.approx(0.010 + 2 * 3.2e-3)
    assert overlapped == pytest.approx(0.010 + 3.2e-3)


def test_more_ps_tasks_share_the_bytes():
    one, _ = predict(profile(workers=4), 1e9)  # four workers: the ps's card limits, not the workers' own
    two, bottleneck = predict(profile(workers=4, ps=2), 1e9)
    assert bottleneck.startswith("the ps's link")
    assert two == pytest.approx(one / 2)


def test_sync_ps_pays_every_workers_transfers_through_the_ps():
    seconds, bottleneck = predict(profile(strategy="sync-ps"), 1e9, workers=4)
    assert seconds == pytest.approx(0.005 + 4 * 2 * 4 * MB / 125e6)
    assert bottleneck == "the ps's link"
