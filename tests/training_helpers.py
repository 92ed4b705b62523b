"""Model, loss and data shared by the training tests (small, real: scikit-learn's digits)."""

import keras

import workbench as wb


def make_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train(cluster, **kwargs):
    options = dict(loss=LOSS, optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"], steps=300, batch_size=64, seed=7)
    options.update(kwargs)
    return wb.train(cluster, make_model, wb.datasets.digits, **options)
