"""The Hook base class: MMEngine's hook points and helpers, called by the runner and loops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, warn_ignored

PRIORITIES = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}


def get_priority(priority: int | str) -> int:
    """Priority as an int (lower runs first); accepts MMEngine's names."""
    if isinstance(priority, int):
        return priority
    if isinstance(priority, str) and priority.upper() in PRIORITIES:
        return PRIORITIES[priority.upper()]
    error = ValueError if isinstance(priority, str) else ConfigTypeError  # MMEngine: TypeError for neither
    raise error(f"unknown hook priority {priority!r}: use an int or one of {', '.join(PRIORITIES)}")


def save_waits(runner: Any) -> bool:
    """A checkpoint now would lose an open accumulation window's partial gradients (the strategy keeps them in
    its own buffers, ``Capabilities.partial_gradients``): a save waits for the window's end."""
    wrapper = runner.optim_wrapper
    return (not runner.strategy.capabilities.partial_gradients and callable(getattr(wrapper, "window_open", None))
            and wrapper.window_open())


class Hook:
    """Base class for hooks. Override any of the methods below; all default to doing nothing.

    ``runner.iter`` inside ``after_train_iter`` is the 0-based global index of the iteration just
    run; ``outputs`` holds the parsed (detached) loss tensors. As in MMEngine, the per-mode epoch and
    iteration methods call ``_before_epoch``/``_after_epoch``/``_before_iter``/``_after_iter`` with
    ``mode='train'|'val'|'test'``: override one of those to act in all three modes.
    """

    priority: int | str = "NORMAL"
    stages = ("before_run", "after_load_checkpoint", "before_train", "before_train_epoch", "before_train_iter",
              "after_train_iter", "after_train_epoch", "before_val", "before_val_epoch", "before_val_iter",
              "after_val_iter", "after_val_epoch", "after_val", "before_save_checkpoint", "after_train",
              "before_test", "before_test_epoch", "before_test_iter", "after_test_iter", "after_test_epoch",
              "after_test", "after_run")

    def before_run(self, runner: Any) -> None: ...
    def after_run(self, runner: Any) -> None: ...
    def before_train(self, runner: Any) -> None: ...
    def after_train(self, runner: Any) -> None: ...
    def before_val(self, runner: Any) -> None: ...
    def after_val(self, runner: Any) -> None: ...
    def before_test(self, runner: Any) -> None: ...
    def after_test(self, runner: Any) -> None: ...
    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None: ...
    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None: ...

    def before_train_epoch(self, runner: Any) -> None:
        self._before_epoch(runner, mode="train")

    def before_val_epoch(self, runner: Any) -> None:
        self._before_epoch(runner, mode="val")

    def before_test_epoch(self, runner: Any) -> None:
        self._before_epoch(runner, mode="test")

    def after_train_epoch(self, runner: Any) -> None:
        self._after_epoch(runner, mode="train")

    def after_val_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        self._after_epoch(runner, mode="val")

    def after_test_epoch(self, runner: Any, metrics: dict | None = None) -> None:
        self._after_epoch(runner, mode="test")

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, batch_idx=batch_idx, data_batch=data_batch, mode="train")

    def before_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, batch_idx=batch_idx, data_batch=data_batch, mode="val")

    def before_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self._before_iter(runner, batch_idx=batch_idx, data_batch=data_batch, mode="test")

    def after_train_iter(
        self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: dict | None = None
    ) -> None:
        self._after_iter(runner, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs, mode="train")

    def after_val_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._after_iter(runner, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs, mode="val")

    def after_test_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None) -> None:
        self._after_iter(runner, batch_idx=batch_idx, data_batch=data_batch, outputs=outputs, mode="test")

    def _before_epoch(self, runner: Any, mode: str = "train") -> None: ...
    def _after_epoch(self, runner: Any, mode: str = "train") -> None: ...
    def _before_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, mode: str = "train") -> None: ...
    def _after_iter(self, runner: Any, batch_idx: int, data_batch: Any = None, outputs: Any = None,
                    mode: str = "train") -> None: ...

    # -- helpers with MMEngine's names and semantics -------------------------------------------
    def every_n_epochs(self, runner: Any, n: int, start: int = 0) -> bool:
        """True after epochs ``start``, ``start + n``, ... (1-based: ``runner.epoch + 1 - start`` is a
        multiple of n); never when ``n <= 0`` or before ``start``."""
        dividend = runner.epoch + 1 - start
        return dividend % n == 0 if dividend >= 0 and n > 0 else False

    def every_n_inner_iters(self, batch_idx: int, n: int) -> bool:
        """True after every n-th batch of the epoch (``batch_idx`` is 0-based); never when ``n <= 0``."""
        return (batch_idx + 1) % n == 0 if n > 0 else False

    def every_n_train_iters(self, runner: Any, n: int, start: int = 0) -> bool:
        """True after iterations ``start``, ``start + n``, ... (``runner.iter + 1 - start`` a multiple of n)."""
        dividend = runner.iter + 1 - start
        return dividend % n == 0 if dividend >= 0 and n > 0 else False

    def end_of_epoch(self, dataloader: Any, batch_idx: int) -> bool:
        """True at the last batch of ``dataloader``."""
        return batch_idx + 1 == len(dataloader)

    def is_last_train_epoch(self, runner: Any) -> bool:
        return runner.epoch + 1 == runner.max_epochs

    def is_last_train_iter(self, runner: Any) -> bool:
        return runner.iter + 1 == runner.max_iters

    def get_triggered_stages(self) -> list[str]:
        """The stages (:attr:`stages`, in that order) this hook's class overrides; overriding a generic
        ``_before_iter`` etc. triggers its train, val and test stages."""
        triggered = {stage for stage in Hook.stages if _overridden(self, stage)}
        for method, modes in _GENERIC.items():
            if _overridden(self, method):
                triggered.update(modes)
        return [stage for stage in Hook.stages if stage in triggered]


_GENERIC = {f"_{when}_{unit}": [f"{when}_{mode}_{unit}" for mode in ("train", "val", "test")]
            for when in ("before", "after") for unit in ("epoch", "iter")}


def _overridden(hook: Hook, method: str) -> bool:
    return getattr(type(hook), method) is not getattr(Hook, method)


# -- storage options shared by CheckpointHook and LoggerHook -------------------------------------
def check_switches(where: str, **switches: Any) -> None:
    """On/off arguments of the hook configured at ``where`` must be bools: a string such as 'no' would read as on."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ConfigTypeError(f"{where}.{name}={value!r}: use True or False")


def check_local_storage(where: str, out_dir: Any, backend_args: dict | None,
                        file_client_args: dict | None) -> None:
    """MMEngine's ``out_dir``/``backend_args``/``file_client_args`` checks, local disk only.

    ``where`` is the config key (``default_hooks.checkpoint``). A URI (``s3://...``) or a backend
    other than local disk is a ConfigError; local ``backend_args``/``file_client_args`` have no effect
    and warn once. Both given is an error, as in MMEngine.
    """
    if out_dir is not None and not isinstance(out_dir, str | Path):
        raise ConfigTypeError(f"{where}.out_dir={out_dir!r}: must be a str or Path (a folder) or None")
    if out_dir is not None and "://" in str(out_dir):
        raise ConfigError(f"{where}.out_dir={str(out_dir)!r}: memfit writes to local disk only; mount the "
                          "storage and give its local path")
    if file_client_args is not None and backend_args is not None:
        raise ConfigError(f"{where}: file_client_args and backend_args cannot both be set: keep backend_args")
    for name, args in (("backend_args", backend_args), ("file_client_args", file_client_args)):
        if args is None:
            continue
        if not isinstance(args, dict):
            raise ConfigTypeError(f"{where}.{name}={args!r}: give a dict, e.g. dict(backend='local'), or remove it")
        backend = args.get("backend", "local")
        if backend not in ("local", "disk"):
            raise ConfigError(f"{where}.{name}: backend={backend!r} is not supported, memfit reads and writes "
                              "local disk only: remove it (mount the storage and set out_dir to its path)")
        warn_ignored(f"{where}.{name}", "memfit reads and writes local disk only; remove it")

