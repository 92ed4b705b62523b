"""The workers' input pipelines as the workbench builds them from a data function (run here, in one process)."""

import numpy as np
import tensorflow as tf

from workbench.training.data import DataContext, training_dataset, validation_dataset


def examples(ctx):
    return tf.data.Dataset.from_tensor_slices((np.arange(12, dtype=np.float32), np.arange(12) % 3))


def tuned(ctx):
    options = tf.data.Options()
    options.autotune.enabled = True
    return examples(ctx).map(lambda x, y: (x * 2, y), num_parallel_calls=tf.data.AUTOTUNE).with_options(options)


def test_worker_w_gets_every_nth_batch_of_the_repeated_data():
    first = [x.numpy().tolist() for x, _ in training_dataset(examples, DataContext(0, 2, 2, 0)).take(4)]
    second = [x.numpy().tolist() for x, _ in training_dataset(examples, DataContext(1, 2, 2, 0)).take(3)]
    assert first == [[0, 1], [4, 5], [8, 9], [0, 1]]  # repeated: the data ends at 11 (batches of 2, a pair a step)
    assert second == [[2, 3], [6, 7], [10, 11]]
    assert [x.numpy().tolist() for x, _ in validation_dataset(examples, DataContext(1, 2, 5, 0))] == [[5, 6, 7, 8, 9]]


def test_pipelines_leave_autotuning_off_unless_the_data_function_turned_it_on():
    for made in (training_dataset(examples, DataContext(0, 2, 4, 0)), validation_dataset(examples, DataContext(0, 1, 4, 0))):
        assert made.options().autotune.enabled is False  # a deleted iterator does not wait for the tuning thread
    kept = training_dataset(tuned, DataContext(0, 1, 4, 0))
    assert kept.options().autotune.enabled is True
    assert next(iter(kept))[0].numpy().tolist() == [0, 2, 4, 6]


def test_pipelines_made_while_a_function_is_traced_say_nothing_and_keep_the_same_options():
    # a job makes its workers' pipelines inside a traced function, where Dataset.options() warns on every call
    import warnings

    from workbench.compat.tensorflow import dataset_options

    seen = []

    def make(data):
        made = training_dataset(data, DataContext(0, 2, 4, 0))
        seen.append(dataset_options(made).autotune.enabled)
        return tf.data.experimental.to_variant(made)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for data in (examples, tuned):
            tf.function(lambda data=data: make(data), autograph=False).get_concrete_function()
    assert seen == [False, True]
