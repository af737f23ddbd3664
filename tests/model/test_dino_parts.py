"""DINO's parts: Hungarian matcher, contrastive denoising, deformable sampling, GIoU, ChannelMapper."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torchvision.ops import generalized_box_iou

from memfit.errors import ConfigError
from memfit.model.detection.dino.attention import (
    MultiScaleDeformableAttention,
    _sample_and_weigh,
    multi_scale_deformable_attn,
)
from memfit.model.detection.dino.denoising import CdnQueryGenerator
from memfit.model.detection.dino.losses import aligned_giou
from memfit.model.detection.dino.matcher import HungarianAssigner
from memfit.model.detection.dino.positional import SinePositionalEncoding, coordinate_to_encoding
from memfit.model.detection.dino.transformer import inverse_sigmoid
from memfit.model.detection.necks import ChannelMapper

DINO_COSTS = [dict(type="FocalLossCost", weight=2.0), dict(type="BBoxL1Cost", weight=5.0, box_format="xywh"),
              dict(type="IoUCost", iou_mode="giou", weight=2.0)]


def _random_problem(q: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(q, 3, generator=g)
    boxes = torch.cat([torch.rand(q, 2, generator=g) * 0.6 + 0.2, torch.rand(q, 2, generator=g) * 0.3 + 0.05], 1)
    xy = torch.rand(n, 2, generator=g) * 40
    gt_boxes = torch.cat([xy, xy + 5 + torch.rand(n, 2, generator=g) * 20], 1)
    return logits, boxes, torch.randint(0, 3, (n,), generator=g), gt_boxes


@pytest.mark.parametrize(("q", "n", "seed"), [(5, 3, 0), (4, 4, 1), (6, 2, 2), (3, 5, 3)])
def test_matcher_finds_the_brute_force_minimum_cost_assignment(q, n, seed):
    assigner = HungarianAssigner(DINO_COSTS)
    logits, boxes, labels, gt_boxes = _random_problem(q, n, seed)
    rows, cols = assigner.assign(logits, boxes, labels, gt_boxes, (64, 80))
    cost = assigner.cost(logits, boxes, labels, gt_boxes, (64, 80))
    assert len(rows) == len(cols) == min(q, n) and len(set(rows.tolist())) == len(rows)
    best = min(sum(cost[r, c] for r, c in zip(perm, range(n)) if r is not None)
               for perm in itertools.permutations(list(range(q)) + [None] * max(0, n - q), n))
    torch.testing.assert_close(cost[rows, cols].sum(), torch.as_tensor(best))


def test_matcher_costs_are_mmdetections_formulas():
    logits, boxes, labels, gt_boxes = _random_problem(4, 3, 7)
    h, w = 64, 80
    p = logits.sigmoid()
    focal = (-(p + 1e-12).log() * 0.25 * (1 - p) ** 2) - (-(1 - p + 1e-12).log() * 0.75 * p ** 2)
    factor = torch.tensor([w, h, w, h])
    gt = gt_boxes / factor
    gt_cxcywh = torch.stack([(gt[:, 0] + gt[:, 2]) / 2, (gt[:, 1] + gt[:, 3]) / 2, gt[:, 2] - gt[:, 0],
                             gt[:, 3] - gt[:, 1]], 1)
    pred_xyxy = torch.cat([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2], 1) * factor
    expected = (2.0 * focal[:, labels] + 5.0 * (boxes[:, None] - gt_cxcywh[None]).abs().sum(-1)
                - 2.0 * generalized_box_iou(pred_xyxy, gt_boxes))
    torch.testing.assert_close(HungarianAssigner(DINO_COSTS).cost(logits, boxes, labels, gt_boxes, (h, w)), expected)


def test_matcher_stand_in_on_fake_tensors_pairs_query_i_with_target_i():
    assigner = HungarianAssigner(DINO_COSTS)
    with FakeTensorMode():
        for q, n in ((5, 3), (2, 4)):
            logits, boxes, labels, gt_boxes = (torch.randn(q, 3), torch.rand(q, 4), torch.zeros(n, dtype=torch.long),
                                               torch.rand(n, 4))
            rows, cols = assigner.assign(logits, boxes, labels, gt_boxes, (32, 32))
            assert rows.shape == cols.shape == (min(q, n),)
    real_rows, _ = assigner.assign(torch.randn(5, 3), torch.rand(5, 4), torch.zeros(0, dtype=torch.long),
                                   torch.zeros(0, 4), (32, 32))
    assert real_rows.numel() == 0  # no targets: nothing matched


def test_matcher_config_errors():
    with pytest.raises(ConfigError, match=r"match_costs\[1\]: BBoxL1Cost takes no 'wieght'"):
        HungarianAssigner([dict(type="FocalLossCost"), dict(type="BBoxL1Cost", wieght=5.0)])
    with pytest.raises(ConfigError, match="iou_mode='diou'"):
        HungarianAssigner([dict(type="IoUCost", iou_mode="diou")])


def _generator(**kw) -> CdnQueryGenerator:
    torch.manual_seed(0)
    return CdnQueryGenerator(num_classes=5, embed_dims=8, num_matching_queries=4, **kw)


def test_denoising_mask_keeps_groups_and_matching_queries_apart():
    gen = _generator(group_cfg=dict(dynamic=True, num_dn_queries=6))
    labels = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    boxes = [torch.tensor([[0.1, 0.1, 0.5, 0.5], [0.2, 0.3, 0.6, 0.9], [0.5, 0.5, 0.9, 0.7]]),
             torch.tensor([[0.3, 0.2, 0.4, 0.8]])]
    label_q, box_q, mask, meta = gen(labels, boxes)
    assert meta == dict(num_denoising_queries=12, num_denoising_groups=2)  # 6 // max 3 targets = 2 groups
    assert label_q.shape == (2, 12, 8) and box_q.shape == (2, 12, 4) and mask.shape == (16, 16)
    group = [i // 6 for i in range(12)] + [None] * 4  # 2 groups of 2 * 3 denoising queries, then 4 matching
    for r, c in itertools.product(range(16), range(16)):
        if group[r] is None:  # a matching query sees only matching queries
            assert bool(mask[r, c]) == (group[c] is not None), (r, c)
        else:  # a denoising query sees its own group and the matching queries
            assert bool(mask[r, c]) == (group[c] is not None and group[c] != group[r]), (r, c)
    # image 1 has one target: its slots 1, 2 (and 4, 5, ...) are padding, zero
    assert label_q[1, [1, 2, 4, 5]].abs().sum() == 0 and label_q[1, [0, 3, 6, 9]].abs().sum() > 0


def test_denoising_noise_positives_inside_negatives_outside_the_half_box():
    gen = _generator(box_noise_scale=1.0, group_cfg=dict(dynamic=False, num_groups=50))
    gt = torch.tensor([[0.3, 0.3, 0.5, 0.6]])
    _, box_q, _, meta = gen([torch.tensor([2])], [gt])
    assert meta["num_denoising_groups"] == 50
    cxcywh = box_q[0].sigmoid()  # [100, 4]: positive, negative, positive, ...
    xyxy = torch.cat([cxcywh[:, :2] - cxcywh[:, 2:] / 2, cxcywh[:, :2] + cxcywh[:, 2:] / 2], 1)
    wh = torch.tensor([0.2, 0.3, 0.2, 0.3])
    shift = ((xyxy - gt) / wh).abs()  # corner moves in units of the box size; noise scale 1 -> up to 1/2 (pos)
    assert (shift[0::2] <= 0.5 + 1e-2).all()
    # negatives move every corner by 1/2 to 1 box size; those whose corners crossed collapse to width 1e-3
    # in cxcywh (as in MMDetection), so only the others decode back to their corners
    intact = (cxcywh[1::2, 2:] > 2e-3).all(-1)
    assert intact.sum() >= 10 and (shift[1::2][intact] >= 0.5 - 1e-2).all()
    # labels: a share label_noise_scale / 2 = 25% is redrawn (at random, so some keep their class)
    one_group = _generator(group_cfg=dict(dynamic=False, num_groups=1))
    label_q, _, _, _ = one_group([torch.full((500,), 2)], [gt.repeat(500, 1)])
    kept = (label_q[0] == one_group.label_embedding.weight[2]).all(-1).float().mean()
    assert 0.70 < kept < 0.85


def test_denoising_without_targets_gives_no_queries():
    label_q, box_q, mask, meta = _generator()([torch.zeros(0, dtype=torch.long)], [torch.zeros(0, 4)])
    assert label_q.shape == (1, 0, 8) and box_q.shape == (1, 0, 4) and not mask.any()
    assert meta == dict(num_denoising_queries=0, num_denoising_groups=1)


def test_deformable_sampling_at_pixel_centres_reads_the_pixels():
    """One point per level with all the weight on level 1: sampling at a pixel centre returns that pixel."""
    torch.manual_seed(0)
    shapes = [(4, 6), (3, 5)]
    value = torch.randn(2, sum(h * w for h, w in shapes), 2, 3)  # [B, S, heads, d]
    y, x = 1, 3
    loc = torch.zeros(2, 1, 2, 2, 1, 2)
    loc[..., 1, 0, :] = torch.tensor([(x + 0.5) / 5, (y + 0.5) / 3])
    weights = torch.zeros(2, 1, 2, 2, 1)
    weights[..., 1, 0] = 1.0
    out = multi_scale_deformable_attn(value, shapes, loc, weights)
    expected = value[:, 4 * 6 + y * 5 + x].reshape(2, 6)
    torch.testing.assert_close(out[:, 0], expected)


def test_deformable_sampling_recomputes_in_backward_with_the_same_gradients():
    """The sampling keeps only its inputs for the backward (MMCV's memory profile) and recomputes the
    samples there: its gradients equal plain autograd's through the same ops."""
    torch.manual_seed(0)
    shapes = ((4, 6), (2, 3))
    inputs = [torch.randn(2, 30, 2, 3), torch.rand(2, 5, 2, 2, 3, 2), torch.rand(2, 5, 2, 2, 3).softmax(-1)]
    grad_out = torch.randn(2, 5, 6)
    ours = [t.clone().requires_grad_() for t in inputs]
    plain = [t.clone().requires_grad_() for t in inputs]
    multi_scale_deformable_attn(ours[0], list(shapes), ours[1], ours[2]).backward(grad_out)
    _sample_and_weigh(plain[0], plain[1], plain[2], shapes).backward(grad_out)
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a.grad, b.grad)


def test_deformable_attention_masks_padding_and_starts_with_mmcvs_ring_of_offsets():
    attn = MultiScaleDeformableAttention(embed_dims=8, num_heads=4, num_levels=2, num_points=3, dropout=0.0)
    bias = attn.sampling_offsets.bias.view(4, 2, 3, 2)
    # head 0 looks right (1, 0), head 1 up (0, 1) ...; point k at distance k + 1 on every level
    torch.testing.assert_close(bias[0, 1], torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(bias[1, 0, 2], torch.tensor([0.0, 3.0]), atol=1e-6, rtol=0)
    shapes = [(2, 2), (1, 1)]
    query, value = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    ref = torch.rand(1, 3, 2, 2)
    pad = torch.tensor([[False, False, False, False, True]])
    out = attn(query, value, None, pad, ref, shapes)
    changed = value.clone()
    changed[0, 4] = 100.0  # a padded position's value never reaches the output
    torch.testing.assert_close(attn(query, changed, None, pad, ref, shapes), out)


def test_aligned_giou_equals_torchvisions_pairwise_giou():
    g = torch.Generator().manual_seed(0)
    a = torch.rand(6, 2, generator=g) * 10
    a = torch.cat([a, a + torch.rand(6, 2, generator=g) * 10 + 0.1], 1)
    b = torch.rand(6, 2, generator=g) * 10
    b = torch.cat([b, b + torch.rand(6, 2, generator=g) * 10 + 0.1], 1)
    torch.testing.assert_close(aligned_giou(a, b), generalized_box_iou(a, b).diagonal())


def test_positional_encodings_and_inverse_sigmoid():
    pe = SinePositionalEncoding(num_feats=4, normalize=True, temperature=20)
    mask = torch.zeros(1, 2, 3, dtype=torch.bool)
    mask[:, :, 2] = True  # the last column is padding
    pos = pe(mask, torch.zeros(1, 8, 2, 3))
    assert pos.shape == (1, 8, 2, 3)
    x_embed = 2 / (2 + 1e-6) * 2 * math.pi  # second valid column, normalised by the 2 valid columns
    torch.testing.assert_close(pos[0, 4:, 0, 1], torch.tensor([math.sin(x_embed), math.cos(x_embed),
                                                               math.sin(x_embed / 20 ** 0.5),
                                                               math.cos(x_embed / 20 ** 0.5)]))
    enc = coordinate_to_encoding(torch.tensor([[[0.25, 0.5, 0.1, 0.2]]]), num_feats=2)
    torch.testing.assert_close(enc[0, 0, :2], torch.tensor([math.sin(math.pi), math.cos(math.pi)]))  # y first
    x = torch.tensor([0.0, 0.2, 0.5, 1.0])
    torch.testing.assert_close(inverse_sigmoid(x).sigmoid(), x.clamp(1e-5, 1 - 1e-5), atol=1e-6, rtol=0)


def test_channel_mapper_extra_level_and_mmdetection_parameter_names():
    neck = ChannelMapper([8, 16], out_channels=16, kernel_size=1, act_cfg=None,
                         norm_cfg=dict(type="GN", num_groups=4), num_outs=4)
    outs = neck([torch.randn(1, 8, 16, 16), torch.randn(1, 16, 8, 8)])
    assert [tuple(o.shape) for o in outs] == [(1, 16, 16, 16), (1, 16, 8, 8), (1, 16, 4, 4), (1, 16, 2, 2)]
    names = set(dict(neck.named_parameters()))
    assert {"convs.0.conv.weight", "convs.1.gn.bias", "extra_convs.0.conv.weight", "extra_convs.1.gn.weight"} <= names
    assert "convs.0.conv.bias" not in names  # no bias before a norm (ConvModule's bias='auto')
    with pytest.raises(ConfigError, match="act_cfg"):
        ChannelMapper([8], 16, act_cfg=dict(type="GELU"))


def test_ffn_under_selective_checkpointing_equals_plain():
    """Selective checkpointing saves the Linear's output: the FFN's ReLU must not overwrite it in place
    (torch refuses the recompute then), and the gradients are those without checkpointing."""
    from memfit.memory.checkpointing import apply_activation_checkpointing
    from memfit.model.detection.dino.attention import FFN

    torch.manual_seed(0)
    plain = FFN(16, 64, act_cfg=dict(type="ReLU", inplace=True))
    checkpointed = FFN(16, 64, act_cfg=dict(type="ReLU", inplace=True))
    checkpointed.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(checkpointed, dict(types=["FFN"], selective=True))
    x = torch.randn(2, 5, 16)
    grads = []
    for model in (plain, checkpointed):
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
