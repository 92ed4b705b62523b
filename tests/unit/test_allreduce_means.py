"""All-reduce's reported loss and metrics: the workers' own, averaged in the kernel."""

import pytest

from workbench.training.strategies.allreduce.trainer import global_means


def test_each_steps_loss_and_metrics_are_the_mean_of_the_workers():
    losses, metrics = global_means([{"losses": [1.0, 2.0], "metrics": [[0.5, 4.0], [1.0, 2.0]]},
                                    {"losses": [3.0, 4.0], "metrics": [[0.7, 0.0], [0.0, 2.0]]}])
    assert losses == [2.0, 3.0]
    assert metrics == [pytest.approx([0.6, 2.0]), pytest.approx([0.5, 2.0])]


def test_a_job_without_metrics_gets_an_empty_list_a_step():
    losses, metrics = global_means(iter([{"losses": [1.0], "metrics": [[]]}, {"losses": [3.0], "metrics": [[]]}]))
    assert losses == [2.0] and metrics == [[]]
