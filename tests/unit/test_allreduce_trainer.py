"""The kernel's side of all-reduce: the requests of steps it sends the workers, and the loss and metrics it reports
(the workers' own, averaged in the kernel)."""

import pytest

from workbench.training.strategies.allreduce.trainer import REQUEST_SECONDS, global_means, request_calls


def test_each_steps_loss_and_metrics_are_the_mean_of_the_workers():
    losses, metrics = global_means([{"losses": [1.0, 2.0], "metrics": [[0.5, 4.0], [1.0, 2.0]]},
                                    {"losses": [3.0, 4.0], "metrics": [[0.7, 0.0], [0.0, 2.0]]}])
    assert losses == [2.0, 3.0]
    assert metrics == [pytest.approx([0.6, 2.0]), pytest.approx([0.5, 2.0])]


def test_a_job_without_metrics_gets_an_empty_list_a_step():
    losses, metrics = global_means(iter([{"losses": [1.0], "metrics": [[]]}, {"losses": [3.0], "metrics": [[]]}]))
    assert losses == [2.0] and metrics == [[]]


def test_an_untimed_request_carries_one_call_and_a_timed_one_as_many_as_fit_in_its_time():
    assert request_calls(0, 100, 10, call_seconds=0.0) == [10]  # the job's first call traces: nothing to pace by
    assert request_calls(10, 100, 10, call_seconds=REQUEST_SECONDS / 4) == [10, 10, 10, 10]
    assert request_calls(10, 100, 10, call_seconds=REQUEST_SECONDS * 3) == [10]  # a long call goes alone


def test_a_request_stops_at_the_epochs_end_with_a_shorter_last_call():
    assert request_calls(80, 95, 10, call_seconds=0.001) == [10, 5]
    assert request_calls(90, 95, 10, call_seconds=0.001) == [5]


def test_a_request_ends_with_the_call_a_checkpoint_falls_due_after():
    # the checkpoint of step 30 must hold the weights of step 30: nothing of that request runs past it
    assert request_calls(0, 100, 10, call_seconds=0.001, due=lambda step: step >= 30) == [10, 10, 10]
    assert request_calls(25, 100, 10, call_seconds=0.001, due=lambda step: step >= 30) == [10]
