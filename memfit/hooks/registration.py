"""The runner's hooks: MMEngine's default hooks, registering hooks by priority, calling them."""

from __future__ import annotations

from typing import Any

from memfit.errors import ConfigError, ConfigTypeError, did_you_mean
from memfit.hooks.base import Hook, get_priority
from memfit.registry import HOOKS

# MMEngine's default hooks; entries of ``default_hooks`` replace or (set to None) remove them.
DEFAULT_HOOKS: dict[str, dict] = dict(
    runtime_info=dict(type="RuntimeInfoHook"),
    timer=dict(type="IterTimerHook"),
    sampler_seed=dict(type="DistSamplerSeedHook"),
    logger=dict(type="LoggerHook", interval=10),
    param_scheduler=dict(type="ParamSchedulerHook"),
    checkpoint=dict(type="CheckpointHook", interval=1),
    check_invalid_loss=dict(type="CheckInvalidLossHook", interval=10, action="stop"),  # synced with the log line
    preemption=dict(type="PreemptionHook"),  # memfit's: save and stop on SIGTERM/SIGUSR1
)


class RunnerHooks:
    """The Runner's hook list (``self._hooks``): ``default_hooks`` merged over :data:`DEFAULT_HOOKS`, then
    ``custom_hooks``, each built from its config and kept in priority order."""

    _hooks: list[Hook]

    def _register_hooks(self, default_hooks: dict | None, custom_hooks: list | None) -> None:
        merged = dict(DEFAULT_HOOKS)
        for name, hook in (default_hooks or {}).items():
            if hook is None:
                merged.pop(name, None)
            elif isinstance(hook, dict) and name in merged and "type" not in hook:
                merged[name] = {**merged[name], **hook}
            elif isinstance(hook, dict) and "type" not in hook:
                raise ConfigError(f"default_hooks.{name}: not a default hook, and no 'type' to build a new one: "
                                  f"{did_you_mean(name, DEFAULT_HOOKS)}")
            else:
                merged[name] = hook
        for name, hook in merged.items():
            self.register_hook(hook, key=f"default_hooks.{name}")
        for i, hook in enumerate(custom_hooks or []):
            self.register_hook(hook, key=f"custom_hooks[{i}]")

    def register_hook(self, hook: Hook | dict, priority: int | str | None = None, key: str = "hook") -> None:
        """Add a hook (object or config); hooks run in priority order, ties in registration order."""
        if isinstance(hook, dict):
            hook = dict(hook)
            priority = hook.pop("priority", priority)
            hook = HOOKS.build(hook, key=key)
        if not isinstance(hook, Hook):
            raise ConfigTypeError(f"{key}: a hook must subclass memfit.hooks.Hook, got {type(hook).__name__}")
        if priority is not None:
            hook.priority = priority
        p = get_priority(hook.priority)
        at = len(self._hooks)
        for i, h in enumerate(self._hooks):
            if p < get_priority(h.priority):
                at = i
                break
        self._hooks.insert(at, hook)

    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        for hook in self._hooks:
            getattr(hook, fn_name)(self, **kwargs)
