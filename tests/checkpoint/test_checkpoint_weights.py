"""load_weights (load_from): sources, prefix, revise_keys, key_map, strict, shape mismatch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from memfit.checkpoint import load_weights, save_checkpoint
from memfit.errors import CheckpointError


class Net(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
        self.head = nn.Linear(8, classes)


def _trained(classes: int = 3) -> Net:
    torch.manual_seed(0)
    net = Net(classes)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))
        net.backbone[1].running_mean.add_(1.0)
    return net


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.fixture
def memfit_log(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    # memfit.logger.get_logger turns propagation off; re-enable it so caplog sees the records.
    monkeypatch.setattr(logging.getLogger("memfit"), "propagate", True)
    caplog.set_level(logging.INFO, logger="memfit")
    return caplog


@pytest.mark.parametrize("form", ["memfit", "model-key", "plain", "safetensors", "dict"])
def test_loads_every_source_form(tmp_path: Path, form: str) -> None:
    src = _trained()
    sd = src.state_dict()
    source: object
    if form == "memfit":
        source = tmp_path / "epoch_1.pth"
        save_checkpoint({"state_dict": sd, "optimizer": {"state": {}}, "meta": {"epoch": 1}}, source)
    elif form == "model-key":
        source = tmp_path / "timm.pth"
        torch.save({"model": sd, "epoch": 5}, source)
    elif form == "plain":
        source = tmp_path / "plain.pth"
        torch.save(sd, source)
    elif form == "safetensors":
        source = tmp_path / "w.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items()}, source)
    else:
        source = {"state_dict": sd}
    dst = Net()
    assert load_weights(dst, source) == ([], [])
    _assert_same(src, dst)


def test_default_revise_keys_strip_module_prefix(tmp_path: Path) -> None:
    src = _trained()
    torch.save({f"module.{k}": v for k, v in src.state_dict().items()}, tmp_path / "ddp.pth")
    dst = Net()
    load_weights(dst, tmp_path / "ddp.pth")
    _assert_same(src, dst)


def test_custom_revise_keys_replace_the_default(tmp_path: Path) -> None:
    src = _trained()
    torch.save({f"model.net.{k}": v for k, v in src.state_dict().items()}, tmp_path / "w.pth")
    dst = Net()
    load_weights(dst, tmp_path / "w.pth", revise_keys=[(r"^model\.", ""), (r"^net\.", "")])
    _assert_same(src, dst)


def test_prefix_selects_a_submodule(tmp_path: Path) -> None:
    src = _trained()
    save_checkpoint({"state_dict": src.state_dict()}, tmp_path / "full.pth")
    backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    assert load_weights(backbone, tmp_path / "full.pth", prefix="backbone.") == ([], [])
    _assert_same(src.backbone, backbone)
    with pytest.raises(
        CheckpointError, match=r"no key starts with prefix 'encoder\.'.*'backbone\.', 'head\.'"
    ):
        load_weights(backbone, tmp_path / "full.pth", prefix="encoder.")


def test_key_map_dict_renames_prefixes_and_exact_keys(tmp_path: Path) -> None:
    src = _trained()
    renamed = {
        k.replace("backbone.", "encoder.").replace("head.weight", "fc_w"): v
        for k, v in src.state_dict().items()
    }
    torch.save(renamed, tmp_path / "w.pth")
    dst = Net()
    load_weights(dst, tmp_path / "w.pth", key_map={"encoder.": "backbone.", "fc_w": "head.weight"})
    _assert_same(src, dst)


def test_key_map_callable_drops_a_head_of_another_size(tmp_path: Path, memfit_log) -> None:
    src = _trained(classes=10)
    save_checkpoint({"state_dict": src.state_dict()}, tmp_path / "pre.pth")
    dst = Net(classes=3)
    head_before = dst.head.weight.clone()
    missing, unexpected = load_weights(
        dst, tmp_path / "pre.pth", strict=False, key_map=lambda k: None if k.startswith("head.") else k
    )
    assert missing == ["head.bias", "head.weight"] and unexpected == []
    _assert_same(src.backbone, dst.backbone)
    assert torch.equal(dst.head.weight, head_before)
    assert "2 missing keys [head.bias, head.weight]" in memfit_log.text


def test_shape_mismatch_names_file_key_and_shapes(tmp_path: Path) -> None:
    save_checkpoint({"state_dict": _trained(classes=10).state_dict()}, tmp_path / "pre.pth")
    dst = Net(classes=3)
    for strict in (True, False):
        with pytest.raises(CheckpointError) as excinfo:
            load_weights(dst, tmp_path / "pre.pth", strict=strict)
        msg = str(excinfo.value)
        assert str(tmp_path / "pre.pth") in msg and "\n" not in msg
        assert "'head.weight': checkpoint (10, 8) vs model (3, 8) (and 1 more)" in msg


def test_strict_reports_missing_and_unexpected_without_touching_model(tmp_path: Path) -> None:
    src = _trained()
    sd = src.state_dict()
    sd.pop("head.bias")
    sd["extra.weight"] = torch.ones(1)
    torch.save(sd, tmp_path / "w.pth")
    dst = Net()
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"1 missing keys \[head.bias\]; 1 unexpected keys \[extra.weight\]"
    ):
        load_weights(dst, tmp_path / "w.pth")
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())


def test_non_strict_logs_and_returns_keys(tmp_path: Path, memfit_log) -> None:
    src = _trained()
    sd = src.state_dict()
    sd.pop("head.bias")
    sd["extra.weight"] = torch.ones(1)
    torch.save(sd, tmp_path / "w.pth")
    dst = Net()
    missing, unexpected = load_weights(dst, tmp_path / "w.pth", strict=False)
    assert (missing, unexpected) == (["head.bias"], ["extra.weight"])
    assert torch.equal(dst.head.weight, src.head.weight)
    record = next(r for r in memfit_log.records if r.levelno == logging.WARNING)
    assert "1 missing keys [head.bias]" in record.getMessage()
    assert "1 unexpected keys [extra.weight]" in record.getMessage()
    assert str(tmp_path / "w.pth") in record.getMessage()


def test_non_tensor_entry_and_unsafe_file_are_errors(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(1), "note": "hi"}, tmp_path / "w.pth")
    with pytest.raises(CheckpointError, match=r"entry 'note' is a <class 'str'>, not a tensor"):
        load_weights(Net(), tmp_path / "w.pth")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="cannot load weights .*bad.safetensors"):
        load_weights(Net(), tmp_path / "bad.safetensors")
