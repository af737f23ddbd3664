"""Regional torch.compile (memfit.speed.compile): exact against eager with inductor on this CPU, with and
without activation checkpointing; blocks vs the whole model; its options and missing-compiler errors; the
Runner trains through it.

The models are tiny and share one block shape, so inductor's graph cache turns the later compiles into
cache hits: a cold cache costs about 15 s for the file on this 2-core VM, a warm one a few seconds."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from memfit.errors import ConfigError
from memfit.memory.checkpointing import apply_activation_checkpointing
from memfit.model import BaseModel
from memfit.speed import apply_compile, check_compiler, compile_options, compiled_modules
from memfit.speed import compile as compile_module

# Inductor's CPU kernels fuse and reorder the fp32 arithmetic: equal to eager to rounding.
TOL = dict(rtol=1e-4, atol=1e-5)


class ConvBlock(nn.Module):
    """A residual conv block with a train-mode BatchNorm: its running statistics must be updated once per
    step also when the block is checkpointed and compiled."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.bn(self.conv(x)))


class Net(BaseModel):
    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 1)
        self.blocks = nn.Sequential(*[ConvBlock() for _ in range(blocks)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, mode: str = "tensor") -> dict | torch.Tensor:
        logits = self.head(self.blocks(self.stem(x)).mean((2, 3)))
        return {"loss": nn.functional.cross_entropy(logits, y)} if mode == "loss" else logits


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 8, 8, generator=g), torch.tensor([0, 1])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    yield
    torch._dynamo.reset()  # no compiled entries carried into the next test


def _step(model: nn.Module) -> tuple[torch.Tensor, dict, dict]:
    x, y = _batch()
    loss = model(x, y, mode="loss")["loss"]
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _assert_same(a: tuple, b: tuple) -> None:
    torch.testing.assert_close(a[0], b[0], **TOL)
    for got, want in zip(a[1:], b[1:]):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_regional_inductor_compile_is_exact_with_and_without_checkpointing():
    eager = Net()
    reference = _step(copy.deepcopy(eager))

    compiled = copy.deepcopy(eager)
    assert apply_compile(compiled, compile_options(True)) == ["blocks.0", "blocks.1", "blocks.2"]
    _assert_same(_step(compiled), reference)

    # Checkpointing first, then compile (the connector's order): the compiled block traces its checkpoint;
    # the BatchNorm statistics (buffers) are updated once, as in eager without checkpointing.
    both = copy.deepcopy(eager)
    apply_activation_checkpointing(both, dict(types=["ConvBlock"]))
    apply_compile(both, compile_options(True))
    _assert_same(_step(both), reference)
    assert compiled_modules(both) == ["blocks.0", "blocks.1", "blocks.2"]


def test_regional_compiles_the_blocks_and_whole_the_model(caplog):
    caplog.set_level(logging.INFO, logger="memfit")
    regional = Net()
    apply_compile(regional, compile_options(dict(backend="eager")))
    assert compiled_modules(regional) == ["blocks.0", "blocks.1", "blocks.2"]
    whole = Net()
    assert apply_compile(whole, compile_options(dict(regional=False, backend="eager"))) == [""]
    assert compiled_modules(whole) == [""]
    assert whole.state_dict().keys() == Net().state_dict().keys()  # no '_orig_mod.' prefix
    assert compiled_modules(copy.deepcopy(whole)) == []  # an EMA copy is a plain module

    caplog.clear()
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))  # no repeated composite block
    assert apply_compile(flat, compile_options(dict(backend="eager"))) == [""]
    assert {r.getMessage() for r in caplog.records} == {
        "compile: Sequential has no repeated blocks; compiling the whole model"}


@pytest.mark.parametrize("spec, message", [
    (dict(mod="max-autotune"), r"^compile\.mod: unknown option; valid: regional, fullgraph, dynamic, backend, mode"),
    (dict(regional="yes"), r"^compile\.regional must be True \(each repeated block\) or False"),
    ("inductor", r"^compile must be True, False or a dict of torch.compile options, got str"),
])
def test_compile_options_are_checked(spec, message):
    with pytest.raises(ConfigError, match=message):
        compile_options(spec)
    assert compile_options(False) is None and compile_options(True) == {"regional": True}


def test_a_missing_compiler_is_one_line(monkeypatch):
    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^compile: the inductor backend needs a C\+\+ compiler on this CPU "
                                          r"\(none of g\+\+ found\): install g\+\+ or set CXX") as err:
        check_compiler(compile_options(True), torch.device("cpu"))
    assert "\n" not in str(err.value)
    check_compiler(compile_options(dict(backend="aot_eager")), torch.device("cpu"))  # no code generation

    monkeypatch.setattr(compile_module, "has_triton", lambda: False)
    with pytest.raises(ConfigError, match=r"^compile: the inductor backend needs Triton on CUDA .*pip install triton"):
        check_compiler(compile_options(True), torch.device("cuda"))
    check_compiler(compile_options(dict(backend="eager")), torch.device("cuda"))


def test_runner_trains_with_compile(tmp_path):
    from memfit.runner import Runner

    x, y = _batch()
    data = [(x[i % 2], y[i % 2]) for i in range(4)]
    runner = Runner(model=Net(), work_dir=str(tmp_path), compile=True, randomness=dict(seed=0),
                    train_dataloader=dict(batch_size=2, dataset=data, sampler=dict(type="DefaultSampler",
                                                                                     shuffle=False)),
                    train_cfg=dict(by_epoch=False, max_iters=2), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.1)),
                    default_hooks=dict(checkpoint=None, logger=dict(interval=1)))
    before = copy.deepcopy(runner.model.state_dict())
    runner.train()
    assert compiled_modules(runner.model) == ["blocks.0", "blocks.1", "blocks.2"]
    after = runner.model.state_dict()
    assert not torch.equal(after["head.weight"], before["head.weight"])  # it trained
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())


def test_blocks_of_one_type_in_many_shapes_stay_compiled_in_training_and_evaluation():
    """A ResNet-18's 8 basic blocks come in 7 shapes: with evaluation's graphs that is 14 graphs of one code
    object, past dynamo's default limit of 8 (the rest would run eagerly). apply_compile raises the limit."""
    import torchvision
    from torch._dynamo.utils import counters

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch(**{name: 8}):  # dynamo's default, restored after
        torch._dynamo.reset()
        counters.clear()
        model = torchvision.models.resnet18(num_classes=4)
        apply_compile(model, {"regional": True, "backend": "eager"})
        x = torch.randn(2, 3, 32, 32)
        model(x).sum().backward()
        model.eval()
        with torch.no_grad():
            model(x)
        assert getattr(config, name) >= 14
        assert counters["stats"]["unique_graphs"] == 14  # 7 shapes x (training, evaluation), none left eager
        torch._dynamo.reset()


def test_regional_graphs_have_static_shapes_unless_dynamic_is_asked():
    """Without dynamic=False, dynamo's automatic dynamic shapes would give a ResNet's later bottleneck shapes
    symbolic sizes (slower kernels); memfit's regional compile keeps one static graph per shape."""
    import torchvision

    def graphs(options: dict) -> list[bool]:
        symbolic: list[bool] = []

        def backend(gm, example_inputs):
            symbolic.append(any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                isinstance(d, torch.SymInt) for d in x.shape)) for x in example_inputs))
            return gm.forward

        torch._dynamo.reset()
        model = torchvision.models.resnet18(num_classes=4)
        apply_compile(model, {"regional": True, "backend": backend, **options})
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        torch._dynamo.reset()
        return symbolic

    assert graphs({}) and not any(graphs({}))  # 7 shapes, 7 static graphs
    assert any(graphs({"dynamic": None}))  # torch's default: symbolic sizes after the first recompile
