"""The objects ``wb.train`` is configured with: each checks itself, nonsense cannot be written, old keywords say where
they went (pure: no cluster)."""

import inspect

import pytest

import workbench as wb
from workbench.training.config import STRATEGIES, checkpoint_from, recovery_from, strategy_from
from workbench.training.moved import MOVED_ARGUMENTS


def test_train_takes_at_most_twenty_parameters_and_names_its_objects():
    parameters = inspect.signature(wb.train).parameters
    assert len(parameters) <= 20, list(parameters)
    assert {"strategy", "recovery", "checkpoint"} <= set(parameters)
    assert not set(parameters) & set(MOVED_ARGUMENTS)


@pytest.mark.parametrize("name", sorted(MOVED_ARGUMENTS))
def test_each_moved_keyword_names_its_new_place(name):
    with pytest.raises(TypeError, match=rf"wb.train: {name}= is now .+"):
        wb.train(None, None, None, **{name: 1})  # refused before anything else is looked at
    assert MOVED_ARGUMENTS[name].split("=")[0] in {"strategy", "recovery", "checkpoint", "callbacks", "wb.train(...).wait()"}


def test_strategy_options_live_on_the_strategy_they_mean_something_for():
    assert wb.SyncPS(backup_workers=1, transfer="bf16").gradients_per_step(3) == 2
    assert wb.AsyncPS().gradients_per_step(3) is None
    for nonsense, says in ((lambda: wb.AsyncPS(backup_workers=1), "has no option backup_workers=: it is an option of wb.SyncPS"),
                           (lambda: wb.AllReduce(transfer="bf16"), "it is an option of wb.AsyncPS and wb.SyncPS"),
                           (lambda: wb.ModelParallel(partition_bytes=0), "Its options: steps_per_call"),
                           (lambda: wb.SyncPS(1), r"takes its options by name: wb.SyncPS\(transfer=..."),
                           (lambda: wb.Recovery(hang=3), "has no option hang=. Its options: rehost")):
        with pytest.raises(TypeError, match=says):  # an option another object has, or a positional one: not writable
            nonsense()
    with pytest.raises(wb.ConfigurationError, match="transfer='fp8' is not a precision"):
        wb.SyncPS(transfer="fp8")
    with pytest.raises(wb.ConfigurationError, match="steps_per_call=0"):
        wb.AllReduce(steps_per_call=0)
    with pytest.raises(wb.ConfigurationError, match="elastic_batch='all'"):
        wb.AsyncPS(elastic_batch="all")
    with pytest.raises(wb.ConfigurationError, match="leaves no gradient to aggregate with 2 worker"):
        wb.SyncPS(backup_workers=2).check_workers(2, 64)
    assert wb.SyncPS(backup_workers=1, transfer="int8").spelled() == "wb.SyncPS(transfer='int8', backup_workers=1)"
    assert wb.AsyncPS(overlap=True).spelled() == "wb.AsyncPS(overlap=True)"
    with pytest.raises(wb.ConfigurationError, match="overlap='no': pass True"):
        wb.AsyncPS(overlap="no")
    with pytest.raises(TypeError, match="has no option overlap=: it is an option of wb.AsyncPS"):
        wb.SyncPS(overlap=False)


def test_names_give_each_strategys_defaults_and_placed_models_their_own():
    assert {name: type(strategy_from(name, placed=False)) for name in ("async-ps", "sync-ps", "allreduce")} == {
        "async-ps": wb.AsyncPS, "sync-ps": wb.SyncPS, "allreduce": wb.AllReduce}
    assert strategy_from(None, placed=False) == wb.AsyncPS() and strategy_from(None, placed=True) == wb.ModelParallel()
    assert set(STRATEGIES) == {"async-ps", "sync-ps", "allreduce", "model-parallel"}
    with pytest.raises(wb.ConfigurationError, match="'hogwild' is not known"):
        strategy_from("hogwild", placed=False)
    with pytest.raises(wb.ConfigurationError, match="a placed model .* not with wb.SyncPS"):
        strategy_from(wb.SyncPS(), placed=True)
    with pytest.raises(wb.ConfigurationError, match="needs a placed model"):
        strategy_from("model-parallel", placed=False)


def test_recovery_checks_its_policies_and_none_fails_fast():
    assert wb.Recovery().hang_policy == "replace" and recovery_from(None) == wb.Recovery(rehost=False)
    assert recovery_from(None).hang_policy == "wait"
    with pytest.raises(wb.ConfigurationError, match="rehost=False forbids that"):
        wb.Recovery(rehost=False, on_hang="replace")
    with pytest.raises(wb.ConfigurationError, match="straggler_factor=1.2 would flag ordinary calls"):
        wb.Recovery(straggler_factor=1.2)
    with pytest.raises(wb.ConfigurationError, match="on_straggler='skip' is not a policy"):
        wb.Recovery(on_straggler="skip")
    with pytest.raises(wb.ConfigurationError, match="none can be left out"):
        wb.Recovery(on_hang="drop").check_strategy(wb.AllReduce())
    wb.Recovery(on_hang="drop").check_strategy(wb.SyncPS())  # a late gradient, like a backup worker's
    with pytest.raises(wb.ConfigurationError, match="recovery=True"):
        recovery_from(True)


def test_a_checkpoint_is_a_directory_and_how_often(tmp_path):
    assert checkpoint_from(tmp_path) == wb.Checkpoint(str(tmp_path)) and checkpoint_from(None) is None
    assert wb.Checkpoint(tmp_path, every=50, keep=5).directory == str(tmp_path)
    with pytest.raises(wb.ConfigurationError, match="every=-1"):
        wb.Checkpoint(tmp_path, every=-1)
    with pytest.raises(wb.ConfigurationError, match="keep=0"):
        wb.Checkpoint(tmp_path, keep=0)
    with pytest.raises(TypeError, match=r"wb.Checkpoint\(directory, every=..., resume=..., keep=...\)"):
        wb.Checkpoint(tmp_path, 50)  # every= is named
    with pytest.raises(wb.ConfigurationError, match="checkpoint=3"):
        checkpoint_from(3)
