"""Hook helpers with MMEngine's names and semantics (mmengine/hooks/hook.py), on concrete runner states."""

from __future__ import annotations

from types import SimpleNamespace

from memfit.hooks import CheckpointHook, Hook, LoggerHook


def _true_at(predicate, states) -> list[int]:
    return [s for s in states if predicate(s)]


def test_every_n_epochs_counts_from_start():
    hook = Hook()
    at = lambda n, start=0: _true_at(lambda e: hook.every_n_epochs(SimpleNamespace(epoch=e), n, start), range(12))
    # runner.epoch is 0-based: the 3rd, 6th, 9th, 12th epochs end at epoch indices 2, 5, 8, 11.
    assert at(3) == [2, 5, 8, 11]
    # start=5, n=2: epochs 5, 7, 9, 11 (1-based), none before 5 -- MMEngine's save_begin test.
    assert at(2, start=5) == [4, 6, 8, 10]
    assert at(2, start=1) == [0, 2, 4, 6, 8, 10]
    assert at(0) == [] and at(-1) == []


def test_every_n_train_iters_counts_from_start():
    hook = Hook()
    at = lambda n, start=0: _true_at(lambda i: hook.every_n_train_iters(SimpleNamespace(iter=i), n, start), range(10))
    assert at(3) == [2, 5, 8]
    assert at(4, start=2) == [1, 5, 9]  # iterations 2, 6, 10
    assert at(-1) == []


def test_every_n_inner_iters_and_end_of_epoch():
    hook = Hook()
    assert _true_at(lambda b: hook.every_n_inner_iters(b, 3), range(10)) == [2, 5, 8]
    assert not hook.every_n_inner_iters(5, 0)
    loader = [0] * 5
    assert hook.end_of_epoch(loader, 4) and not hook.end_of_epoch(loader, 3)


def test_is_last_train_epoch_and_iter():
    hook = Hook()
    assert hook.is_last_train_epoch(SimpleNamespace(epoch=1, max_epochs=2))
    assert not hook.is_last_train_epoch(SimpleNamespace(epoch=1, max_epochs=3))
    assert not hook.is_last_train_epoch(SimpleNamespace(epoch=1, max_epochs=0))
    assert hook.is_last_train_iter(SimpleNamespace(iter=1, max_iters=2))
    assert not hook.is_last_train_iter(SimpleNamespace(iter=0, max_iters=2))


def test_get_triggered_stages():
    class AfterTrain(Hook):
        def after_train(self, runner):
            return super().after_train(runner)

    class AfterTrainIter(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None): ...

    class BeforeIter(Hook):
        def _before_iter(self, runner, batch_idx, data_batch=None, mode="train"): ...

    class AfterEpochAndVal(Hook):
        def _after_epoch(self, runner, mode="train"): ...
        def after_val_epoch(self, runner, metrics=None): ...

    class HelperOnly(Hook):
        def is_last_train_epoch(self, runner): ...

    assert AfterTrain().get_triggered_stages() == ["after_train"]
    assert AfterTrainIter().get_triggered_stages() == ["after_train_iter"]
    assert set(BeforeIter().get_triggered_stages()) == {"before_train_iter", "before_val_iter", "before_test_iter"}
    assert set(AfterEpochAndVal().get_triggered_stages()) == {"after_train_epoch", "after_val_epoch",
                                                              "after_test_epoch"}
    assert HelperOnly().get_triggered_stages() == [] and Hook().get_triggered_stages() == []
    # The built-in hooks: the stages they act at, in Hook.stages order.
    assert CheckpointHook().get_triggered_stages() == [
        "before_train", "after_train_iter", "after_train_epoch", "after_val_epoch", "after_train", "after_run"]
    logger_stages = set(LoggerHook().get_triggered_stages())
    assert {"before_run", "after_train_iter", "after_val_epoch", "after_run"} <= logger_stages


def test_generic_methods_receive_every_mode():
    calls = []

    class Generic(Hook):
        def _before_epoch(self, runner, mode="train"):
            calls.append(("before_epoch", mode))

        def _after_iter(self, runner, batch_idx, data_batch=None, outputs=None, mode="train"):
            calls.append(("after_iter", mode, batch_idx, outputs))

    hook, runner = Generic(), SimpleNamespace()
    hook.before_train_epoch(runner)
    hook.before_test_epoch(runner)
    hook.after_train_iter(runner, batch_idx=3, outputs={"loss": 1.0})
    hook.after_val_iter(runner, batch_idx=0, outputs=[2])
    hook.after_val_epoch(runner, metrics={"acc": 1.0})  # _after_epoch is not overridden: nothing
    assert calls == [("before_epoch", "train"), ("before_epoch", "test"),
                     ("after_iter", "train", 3, {"loss": 1.0}), ("after_iter", "val", 0, [2])]
