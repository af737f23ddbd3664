"""Strategies are known by what they declare (Capabilities), never by their names.

A strategy registered here, under a name nothing in memfit knows, is treated by the connector, the
planner and the hooks as its declared capabilities say; and no module outside memfit/strategies compares
a strategy's name or class (read from the source).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memfit.connector import _check_in_backward, _check_offload, resolve_optim_wrapper, setup
from memfit.errors import ConfigError
from memfit.hooks.invalid_loss import CheckInvalidLossHook
from memfit.planner.space import ModelFacts, configured_plan
from memfit.precision import Precision
from memfit.registry import STRATEGIES
from memfit.strategies import (
    SHORT_NAMES,
    Capabilities,
    SingleDeviceStrategy,
    Strategy,
    capabilities_of,
    sharding_config,
)

MEMFIT = Path(__file__).parents[2] / "memfit"
SGD = dict(optimizer=dict(type="SGD", lr=0.1))


class ToyShardingStrategy(Strategy):
    """A backend memfit has never heard of: shards gradients and optimizer state, steps its own optimizer."""

    capabilities = Capabilities(shards=frozenset({"optimizer", "gradients"}), data_parallel=True,
                                own_optimizer=True, own_offload="toy_offload=True", fake_step=False,
                                optim_wrappers=frozenset({"ToyOptimWrapper"}),
                                config_hint="strategy=dict(type='ToyShardingStrategy')")

    def __init__(self) -> None:
        super().__init__()
        self.wrappers: list[str] = []

    def use_optim_wrapper(self, name: str) -> None:
        self.wrappers.append(name)


class ToyLocalStrategy(Strategy):
    """One device, under another name than SingleDeviceStrategy."""

    capabilities = Capabilities()


@pytest.fixture(autouse=True)
def registered():
    for cls in (ToyShardingStrategy, ToyLocalStrategy):
        STRATEGIES.register(cls, force=True)
    yield
    for cls in (ToyShardingStrategy, ToyLocalStrategy):
        STRATEGIES._table.pop(cls.__name__, None)


def test_the_connector_maps_a_declared_optimizer_wrapper_onto_its_strategy():
    toy = ToyShardingStrategy()
    assert resolve_optim_wrapper(dict(SGD, type="ToyOptimWrapper"), toy)["type"] == "OptimWrapper"
    assert toy.wrappers == ["ToyOptimWrapper"]
    with pytest.raises(ConfigError, match=r"'ToyOptimWrapper' needs strategy=dict\(type='ToyShardingStrategy'\), "
                                          r"not SingleDeviceStrategy"):
        resolve_optim_wrapper(dict(SGD, type="ToyOptimWrapper"), SingleDeviceStrategy())
    with pytest.raises(ConfigError, match="ToyShardingStrategy already shards the optimizer"):
        resolve_optim_wrapper(dict(SGD, type="ZeroOptimWrapper"), toy)


def test_the_connector_refuses_by_declared_capabilities():
    with pytest.raises(ConfigError, match="ToyShardingStrategy offloads its own optimizer: use toy_offload=True"):
        _check_offload(ToyShardingStrategy(), Precision(), False)
    with pytest.raises(ConfigError, match="one process on one device only"):
        _check_in_backward(ToyShardingStrategy(), SGD, Precision())
    _check_in_backward(ToyLocalStrategy(), SGD, Precision())  # one device: allowed, whatever its name
    no_offload = ToyShardingStrategy()
    no_offload.capabilities = Capabilities(offloads_parameters=True)
    with pytest.raises(ConfigError, match="parameter offload"):
        _check_offload(no_offload, Precision(), False)


def test_a_local_strategy_of_any_name_trains():
    model, wrapper = setup(nn.Linear(3, 2), ToyLocalStrategy(), dict(SGD), optimizer_in_backward=True)
    loss = model(torch.ones(4, 3)).sum()
    wrapper.update_params(loss)


def test_the_invalid_loss_hook_asks_the_capabilities():
    def runner(strategy):
        return SimpleNamespace(optim_wrapper=SimpleNamespace(skip_nonfinite=False), strategy=strategy, world_size=1)

    with pytest.raises(ConfigError, match="one process on one device, not ToyShardingStrategy"):
        CheckInvalidLossHook(action="skip").before_run(runner(ToyShardingStrategy()))
    local = runner(ToyLocalStrategy())
    CheckInvalidLossHook(action="skip").before_run(local)
    assert local.optim_wrapper.skip_nonfinite


def test_the_planner_reads_the_sharding_from_the_capabilities():
    facts = ModelFacts(block_types=(), blocks=(), stages=(), frozen_bn=False)
    cfg = dict(optim_wrapper=dict(SGD), train_dataloader=dict(batch_size=2))
    assert configured_plan({**cfg, "strategy": dict(type="ToyShardingStrategy")}, facts).sharding == "zero2"
    assert configured_plan({**cfg, "strategy": dict(type="ToyLocalStrategy")}, facts).sharding == "none"
    for name, sharding, offload in (("zero", "zero1", "none"), ("fsdp_offload", "fsdp", "params"),
                                    ("fsdp_shard_grad_op", "zero2", "none"), ("deepspeed_stage_3", "fsdp", "none"),
                                    ("deepspeed_stage_3_offload", "fsdp", "params")):
        plan = configured_plan({**cfg, "strategy": name}, facts)
        assert (plan.sharding, plan.offload) == (sharding, offload), name
    assert capabilities_of(sharding_config("zero2", False)).sharding == "zero2"
    assert capabilities_of(sharding_config("fsdp", True)).offloads_parameters


def test_the_fake_step_refuses_a_strategy_that_declares_it_cannot_run_there():
    from memfit.planner.fake import measure_step

    cfg = dict(model=dict(type="ImageClassifier", backbone=dict(type="ResNet", depth=18), num_classes=2),
               optim_wrapper=dict(SGD), strategy=dict(type="ToyShardingStrategy"),
               train_dataloader=dict(batch_size=1))
    with pytest.raises(ConfigError, match="strategy='ToyShardingStrategy': the planner runs"):
        measure_step(cfg, batch=object())


# -- no name checks outside memfit/strategies ------------------------------------------------------

def _strategy_classes() -> set[str]:
    return {n for n in STRATEGIES.names() if not n.startswith("Toy")}


def _names_compared(tree: ast.AST, source: str) -> list[str]:
    classes, short = _strategy_classes(), set(SHORT_NAMES)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            text = ast.get_source_segment(source, node) or ""
            operands = [node.left, *node.comparators]
            operands += [e for o in operands if isinstance(o, ast.Tuple | ast.List | ast.Set) for e in o.elts]
            strings = {o.value for o in operands if isinstance(o, ast.Constant) and isinstance(o.value, str)}
            # the sanctioned way: a strategy's capabilities (their sharding word may read like a short name)
            about_strategy = ("strateg" in text.lower() or "kind" in text) and "capabilities" not in text
            if strings & classes or (about_strategy and (strings & short or "__name__" in text)):
                found.append(f"line {node.lineno}: {text}")
            if any(isinstance(c, ast.Name) and c.id in classes for c in ast.walk(node)):
                found.append(f"line {node.lineno}: {text}")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            if any(isinstance(c, ast.Name) and c.id in classes for c in ast.walk(node.args[1])):
                found.append(f"line {node.lineno}: {ast.get_source_segment(source, node)}")
        elif isinstance(node, ast.Dict):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if keys & classes:
                found.append(f"line {node.lineno}: a table keyed by strategy names {sorted(keys & classes)}")
    return found


def test_no_module_outside_strategies_compares_a_strategys_name_or_class():
    offenders = []
    for path in sorted(MEMFIT.rglob("*.py")):
        if path.parent.name == "strategies" or "strategies" in path.relative_to(MEMFIT).parts:
            continue
        source = path.read_text()
        offenders += [f"{path.relative_to(MEMFIT.parent)} {hit}" for hit in _names_compared(ast.parse(source),
                                                                                            source)]
    assert not offenders, "ask strategy.capabilities instead:\n" + "\n".join(offenders)


def test_the_name_check_finds_what_it_forbids():
    bad = ('if type(runner.strategy).__name__ != "SingleDeviceStrategy": pass\n'
           'if kind in ("FSDPStrategy", "fsdp"): pass\n'
           'if isinstance(s, DDPStrategy): pass\n'
           'HINTS = {"DeepSpeedStrategy": "..."}\n'
           'if strategy == "zero": pass\n')
    assert len(_names_compared(ast.parse(bad), bad)) == 5
    fine = 'if name == "zero": pass\nx = dict(type="DDPStrategy")\nif type(v).__name__ == "bool_": pass\n'
    assert _names_compared(ast.parse(fine), fine) == []
