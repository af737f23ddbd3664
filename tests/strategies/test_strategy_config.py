"""Strategy construction without launching: short names, MMEngine's model_wrapper_cfg, FSDP unit
selection (names, types, FSDP1 auto-wrap policies, the default) and one-line config errors."""

from functools import partial

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

from memfit.checkpoint.dcp import fqn_optim_state
from memfit.errors import ConfigError
from memfit.strategies import SHORT_NAMES, DDPStrategy, FSDPStrategy, build_strategy, strategy_from_model_wrapper
from memfit.strategies.fsdp_units import select_units


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.layers = nn.Sequential(Block(), Block(), nn.Sequential(Block(32), Block(32)))
        self.act = nn.ReLU()
        self.head = nn.Linear(8, 2)


def test_short_names_and_model_wrapper_cfg():
    assert isinstance(build_strategy("ddp"), DDPStrategy)
    assert build_strategy("ddp_zero").zero
    assert build_strategy("fsdp_offload").cpu_offload and isinstance(build_strategy("fsdp"), FSDPStrategy)
    assert {"deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3", "deepspeed_stage_3_offload"} <= set(
        SHORT_NAMES)
    assert SHORT_NAMES["deepspeed_stage_3_offload"]["zero_optimization"]["stage"] == 3
    s = strategy_from_model_wrapper(dict(type="MMFullyShardedDataParallel", cpu_offload=True))
    assert isinstance(s, FSDPStrategy) and s.cpu_offload
    d = strategy_from_model_wrapper(dict(type="MMDistributedDataParallel", find_unused_parameters=True))
    assert isinstance(d, DDPStrategy) and d.ddp_kwargs["find_unused_parameters"]
    with pytest.raises(ConfigError, match="MMFullyShardedDataParallel"):
        strategy_from_model_wrapper(dict(type="MMFullyShardedDataParalel"))
    with pytest.raises(ConfigError, match="unknown strategy 'fsdb'.*fsdp"):
        build_strategy("fsdb")


def test_fsdp1_arguments_are_mapped():
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy

    s = FSDPStrategy(model_wrapper=dict(cpu_offload=CPUOffload(offload_params=True),
                                        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
                                        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, use_orig_params=True))
    assert s.cpu_offload and not s.reshard_after_forward and s.mixed_precision == {"param_dtype": torch.bfloat16}
    assert FSDPStrategy(mixed_precision=dict(param_dtype="bf16", reduce_dtype="float32")).mixed_precision == {
        "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    with pytest.raises(ConfigError, match="NO_SHARD is DDPStrategy"):
        FSDPStrategy(model_wrapper=dict(sharding_strategy="NO_SHARD"))
    with pytest.raises(ConfigError, match="unsupported key 'auto_wrap_polcy'.*auto_wrap_policy"):
        FSDPStrategy(model_wrapper=dict(auto_wrap_polcy=None))
    with pytest.raises(ConfigError, match="state_dict_type"):
        FSDPStrategy(state_dict_type="local_dict")


def test_fsdp1_options_without_an_fsdp2_switch_warn_once(caplog, monkeypatch):
    from torch.distributed.fsdp import BackwardPrefetch

    from memfit import errors
    from memfit.strategies.fsdp_compat import warn_device_id

    monkeypatch.setattr(errors, "_WARNED", set())
    warnings = lambda: sorted({id(r): r.getMessage() for r in caplog.records if r.levelname == "WARNING"}.values())
    # Set as FSDP2 always behaves (FSDP1's defaults, the seeds' use_orig_params=True): silent.
    strategy_from_model_wrapper(dict(type="MMFullyShardedDataParallel", use_orig_params=True, limit_all_gathers=True,
                                     forward_prefetch=False, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                                     sync_module_states=True))
    warn_device_id(0, torch.device("cuda", 0))
    warn_device_id("cuda", torch.device("cuda", 3))
    assert warnings() == []
    other = dict(use_orig_params=False, limit_all_gathers=False, forward_prefetch=True,
                 backward_prefetch=BackwardPrefetch.BACKWARD_POST, param_init_fn=lambda m: m.to_empty(device="cpu"))
    for _ in range(2):
        FSDPStrategy(model_wrapper=other)
        warn_device_id(1, torch.device("cpu"))
    got = warnings()
    for option in ("use_orig_params=False", "limit_all_gathers=False", "forward_prefetch=True",
                   "backward_prefetch=BACKWARD_POST", "param_init_fn", "device_id=1"):
        assert len([m for m in got if m.startswith(f"FSDPStrategy.model_wrapper.{option} has no effect")]) == 1
    assert len(got) == 6


def test_state_dict_cfg_mmengine_values_and_one_line_errors():
    from torch.distributed.fsdp import StateDictType

    assert FSDPStrategy(state_dict_cfg="local").state_dict_type == "sharded"
    assert FSDPStrategy(state_dict_cfg="full").state_dict_type == "full"
    full = dict(state_dict_type="FULL_STATE_DICT", state_dict_config=dict(type="FullStateDictConfig",
                                                                        offload_to_cpu=True, rank0_only=True))
    assert FSDPStrategy(state_dict_cfg=full).state_dict_type == "full"
    local = dict(state_dict_type=StateDictType.LOCAL_STATE_DICT)  # FSDP1's enum
    assert FSDPStrategy(state_dict_cfg=local).state_dict_type == "sharded"
    for bad, match in (("ful", r"state_dict_cfg='ful': use 'local' \(sharded\), 'full'.*did you mean 'full'"),
                       (dict(state_dict_type="FULL"), r"state_dict_cfg.state_dict_type='FULL': use 'local'"),
                       (dict(state_dict_typ="full"), r"state_dict_cfg: unknown key 'state_dict_typ'")):
        with pytest.raises(ConfigError, match=match) as e:
            FSDPStrategy(state_dict_cfg=bad)
        assert "\n" not in str(e.value)


def test_two_ways_of_choosing_units_is_a_one_line_error():
    from functools import partial

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    with pytest.raises(ConfigError, match="wrap_modules and model_wrapper.auto_wrap_policy both choose"):
        FSDPStrategy(wrap_modules=["Block"],
                     model_wrapper=dict(auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=10)))


def test_unit_selection():
    net = Net()
    # Default: repeated composite classes holding parameters, outermost; the Linear head (a leaf layer that
    # repeats Block's Linear) stays in the root unit.
    assert sorted(select_units(net)) == ["layers.0", "layers.1", "layers.2.0", "layers.2.1"]
    assert sorted(select_units(net, ["Block"])) == ["layers.0", "layers.1", "layers.2.0", "layers.2.1"]
    assert sorted(select_units(net, ["layers.2", nn.Conv2d])) == ["layers.2", "stem"]
    with pytest.raises(ConfigError, match="'Blok' matches no module.*Block"):
        select_units(net, ["Blok"])
    # FSDP1 policies evaluated as FSDP1 would: the Block(32)s hold 2*(32*32+32) = 2112 params each.
    assert sorted(select_units(net, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=2000))) \
        == ["layers.2.0", "layers.2.1"]
    # min 100: each Linear(32) (1056) and the stem conv (224) qualify alone; a Linear(8) (72) does not,
    # so its Block (144) does; Block(32)s hold nothing unwrapped after their Linears; head (18) never.
    assert sorted(select_units(net, auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=100))) \
        == ["layers.0", "layers.1", "layers.2.0.a", "layers.2.0.b", "layers.2.1.a", "layers.2.1.b", "stem"]
    assert sorted(select_units(net, auto_wrap_policy=partial(transformer_auto_wrap_policy,
                                                             transformer_layer_cls={Block}))) == \
        ["layers.0", "layers.1", "layers.2.0", "layers.2.1"]
    assert sorted(select_units(net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}))) == ["layers", "layers.2"]


def test_id_keyed_optimizer_state_becomes_name_keyed():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    osd = fqn_optim_state(net, opt, opt.state_dict())
    assert osd["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert torch.equal(osd["state"]["1.bias"]["exp_avg"], opt.state[net[1].bias]["exp_avg"])


def test_backend_wrapper_names_map_onto_their_strategy():
    from memfit.connector import resolve_optim_wrapper
    from memfit.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    sgd = dict(type="SGD", lr=0.1)
    for strategy in (SingleDeviceStrategy(), FSDPStrategy()):
        with pytest.raises(ConfigError, match="needs strategy='ddp'"):
            resolve_optim_wrapper(dict(type="ZeroOptimWrapper", optimizer=sgd), strategy)
    with pytest.raises(ConfigError, match="needs strategy=dict\\(type='DeepSpeedStrategy'"):
        resolve_optim_wrapper(dict(type="DeepSpeedOptimWrapper", optimizer=sgd), DDPStrategy())
    ddp = DDPStrategy()
    assert resolve_optim_wrapper(dict(type="ZeroOptimWrapper", optimizer=sgd), ddp) == dict(type="OptimWrapper",
                                                                                          optimizer=sgd)
    assert ddp.zero
    # MMEngine's form: ZeroRedundancyOptimizer is an optimizer type around optimizer_type.
    ddp = DDPStrategy()
    cfg = resolve_optim_wrapper(dict(optimizer=dict(type="ZeroRedundancyOptimizer", optimizer_type="AdamW", lr=1)),
                                ddp)
    assert cfg == dict(type="OptimWrapper", optimizer=dict(type="AdamW", lr=1)) and ddp.zero
