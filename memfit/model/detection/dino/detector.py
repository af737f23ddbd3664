"""DINO (MMDetection's ``DINO``): backbone -> ChannelMapper -> deformable encoder -> two-stage query selection
-> deformable decoder with box refinement and contrastive denoising -> DINOHead.

Module names are MMDetection's, so activation checkpointing names them: ``backbone.<stage>`` (GC of
Backbone), ``encoder.layers.<i>`` (GC of Encoder), ``decoder.layers.<i>``; or by type
``DeformableEncoderLayer`` / ``DeformableDecoderLayer``. docs/detection.md describes the config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memfit.errors import ConfigError
from memfit.model.base import BaseModel
from memfit.model.detection.data_preprocessor import padding_masks
from memfit.model.detection.dino.config import build_part, pop_type
from memfit.model.detection.dino.denoising import CdnQueryGenerator
from memfit.model.detection.dino.head import DINOHead
from memfit.model.detection.dino.positional import SinePositionalEncoding
from memfit.model.detection.dino.transformer import DeformableEncoder, DINODecoder
from memfit.registry import MODELS


@MODELS.register()
class DINO(BaseModel):
    """DINO detector: ``forward(inputs [B, 3, H, W], data_samples, mode)`` with MMDetection's data-sample
    fields as dicts (``img_shape``, ``scale_factor``, ``ori_shape``, ``gt_instances``).

    ``'loss'`` returns MMDetection's loss dict, ``'predict'`` one dict per image with ``pred_instances``
    (boxes in original-image pixels), ``'tensor'`` the head's raw outputs for every decoder layer (as
    MMDetection's ``_forward``): class logits ``[layers, B, Q, classes]`` and boxes ``[layers, B, Q, 4]``
    (normalised cxcywh), without denoising queries.
    """

    def __init__(self, backbone: nn.Module | dict, neck: nn.Module | dict, encoder: dict | None = None,
                 decoder: dict | None = None, bbox_head: dict | None = None,
                 positional_encoding: dict | None = None, num_queries: int = 900, with_box_refine: bool = True,
                 as_two_stage: bool = True, num_feature_levels: int = 4, dn_cfg: dict | None = None,
                 train_cfg: dict | None = None, test_cfg: dict | None = None,
                 data_preprocessor: nn.Module | dict | None = None, init_cfg: Any = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor, init_cfg=init_cfg)
        if not (with_box_refine and as_two_stage):
            raise ConfigError("model: DINO needs with_box_refine=True and as_two_stage=True (MMDetection asserts both)")
        self.num_queries, self.num_feature_levels = num_queries, num_feature_levels
        self.backbone = MODELS.build(backbone, key="model.backbone")
        self.neck = MODELS.build(neck, key="model.neck")
        self.encoder = build_part(DeformableEncoder, encoder, "model.encoder")
        self.decoder = build_part(DINODecoder, decoder, "model.decoder")
        self.embed_dims = self.encoder.embed_dims
        self._check_levels(neck)
        self.positional_encoding = build_part(SinePositionalEncoding, positional_encoding, "model.positional_encoding")
        if self.positional_encoding.num_feats * 2 != self.embed_dims:
            raise ConfigError(f"model.positional_encoding.num_feats={self.positional_encoding.num_feats}: must be "
                              f"half of embed_dims={self.embed_dims}")
        _, head_cfg = pop_type(bbox_head, "model.bbox_head", ("DINOHead",), default="DINOHead")
        head_cfg.setdefault("embed_dims", self.embed_dims)
        self.bbox_head = build_part(DINOHead, head_cfg, "model.bbox_head", num_pred_layer=self.decoder.num_layers + 1,
                                    train_cfg=train_cfg, test_cfg=test_cfg)
        if self.bbox_head.embed_dims != self.embed_dims:
            raise ConfigError(f"model.bbox_head.embed_dims={self.bbox_head.embed_dims}: must equal the encoder's "
                              f"embed_dims={self.embed_dims}")
        self.dn_query_generator = build_part(
            CdnQueryGenerator, dn_cfg, "model.dn_cfg", num_classes=self.bbox_head.num_classes,
            embed_dims=self.embed_dims, num_matching_queries=num_queries)
        self.query_embedding = nn.Embedding(num_queries, self.embed_dims)
        self.level_embed = nn.Parameter(torch.empty(num_feature_levels, self.embed_dims))
        self.memory_trans_fc = nn.Linear(self.embed_dims, self.embed_dims)
        self.memory_trans_norm = nn.LayerNorm(self.embed_dims)
        self.reset_parameters()

    num_classes_key = "model.bbox_head.num_classes"  # where a config sets num_classes (memfit.checks.check_classes)

    @property
    def num_classes(self) -> int:
        return self.bbox_head.num_classes

    def _check_levels(self, neck: Any) -> None:
        levels = {"model.num_feature_levels": self.num_feature_levels,
                  "model.encoder.layer_cfg.self_attn_cfg.num_levels": self.encoder.layers[0].self_attn.num_levels,
                  "model.decoder.layer_cfg.cross_attn_cfg.num_levels": self.decoder.layers[0].cross_attn.num_levels}
        if getattr(self.neck, "num_outs", None) is not None:
            levels["model.neck.num_outs"] = self.neck.num_outs
        if len(set(levels.values())) > 1:
            shown = ", ".join(f"{k}={v}" for k, v in levels.items())
            raise ConfigError(f"the numbers of feature levels differ: {shown}; set them all to the same value")
        if self.decoder.embed_dims != self.embed_dims:
            raise ConfigError(f"model.decoder embed_dims={self.decoder.embed_dims} must equal model.encoder's "
                              f"{self.embed_dims}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """MMDetection's ``DINO.init_weights``: Xavier-uniform transformer matrices, then the deformable
        attention's own init, Xavier ``memory_trans_fc`` and ``query_embedding``, normal ``level_embed``."""
        for coder in (self.encoder, self.decoder):
            for p in coder.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)
            for layer in coder.layers:
                for attn in (getattr(layer, "self_attn", None), getattr(layer, "cross_attn", None)):
                    if hasattr(attn, "reset_parameters"):
                        attn.reset_parameters()
        nn.init.xavier_uniform_(self.memory_trans_fc.weight)
        nn.init.xavier_uniform_(self.query_embedding.weight)
        nn.init.normal_(self.level_embed)

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, inputs: Tensor, data_samples: list[dict] | None = None, mode: str = "tensor") -> Any:
        if mode not in ("loss", "predict", "tensor"):
            raise ValueError(f"unknown mode {mode!r}: use 'loss', 'predict' or 'tensor'")
        samples = data_samples or [dict(img_shape=tuple(inputs.shape[-2:])) for _ in range(len(inputs))]
        feats = self.neck(self.backbone(inputs))
        if len(feats) != self.num_feature_levels:
            raise ConfigError(f"model.neck gives {len(feats)} feature maps but num_feature_levels="
                              f"{self.num_feature_levels}: set neck.num_outs (and in_channels) to match")
        gts = None
        if mode == "loss":
            gts = [s["gt_instances"] for s in samples]
        out = self.forward_transformer(feats, samples, tuple(inputs.shape[-2:]), gts)
        if mode == "loss":
            return self.bbox_head.loss(out["cls"], out["boxes"], out["enc_cls"], out["enc_boxes"], gts,
                                       [tuple(s["img_shape"]) for s in samples], out["dn_meta"])
        if mode == "tensor":
            return out["cls"], out["boxes"]
        return self.bbox_head.predict(out["cls"][-1], out["boxes"][-1], samples)

    def forward_transformer(self, feats: list[Tensor], samples: list[dict], input_shape: tuple[int, int],
                            gts: list[dict] | None = None) -> dict[str, Any]:
        """Encoder, query selection and decoder; with ``gts`` (training) the denoising queries go first."""
        memory_in, pos, mask, shapes, valid_ratios = self.pre_transformer(feats, samples, input_shape)
        memory = self.encoder(memory_in, pos, mask, shapes, valid_ratios)
        query, reference, enc_cls, enc_boxes = self.select_queries(memory, mask, shapes)
        dn_mask = dn_meta = None
        if gts is not None:
            labels = [g["labels"] for g in gts]
            norm_boxes = [g["bboxes"] / g["bboxes"].new_tensor([w, h, w, h])
                          for g, (h, w) in zip(gts, (tuple(s["img_shape"]) for s in samples))]
            dn_query, dn_box, dn_mask, dn_meta = self.dn_query_generator(labels, norm_boxes)
            query = torch.cat([dn_query, query], dim=1)
            reference = torch.cat([dn_box, reference], dim=1)
        hidden, references = self.decoder(query, memory, mask, dn_mask, reference.sigmoid(), shapes, valid_ratios,
                                          self.bbox_head.reg_branches)
        if dn_meta is not None and dn_meta["num_denoising_queries"] == 0:
            # no targets in this batch: keep label_embedding in the graph (DDP expects every parameter)
            first = torch.zeros(1, dtype=torch.long, device=hidden.device)
            hidden = hidden + self.dn_query_generator.label_embedding(first)[0, 0] * 0.0
        cls, boxes = self.bbox_head(hidden, references)
        return dict(cls=cls, boxes=boxes, enc_cls=enc_cls, enc_boxes=enc_boxes, dn_meta=dn_meta)

    def pre_transformer(self, feats: list[Tensor], samples: list[dict], input_shape: tuple[int, int]
                        ) -> tuple[Tensor, Tensor, Tensor | None, list[tuple[int, int]], Tensor]:
        """Flatten the levels: features ``[B, S, C]``, positional + level embeddings ``[B, S, C]``, the
        padding mask ``[B, S]`` (None when no image of the batch is padded), the level shapes and the
        valid ratios ``[B, levels, 2]`` (w, h) of each level."""
        b = feats[0].shape[0]
        padded = any(tuple(s["img_shape"]) != input_shape for s in samples)
        masks = padding_masks(samples, input_shape, feats[0].device) if padded else None
        flat, pos, flat_masks, shapes, ratios = [], [], [], [], []
        for level, feat in enumerate(feats):
            h, w = feat.shape[-2:]
            shapes.append((h, w))
            m = None if masks is None else F.interpolate(masks[None].float(), size=(h, w))[0].bool()
            # computed in fp32, then the model's dtype: unchanged under autocast, bf16 in a whole-model bf16 DINO
            p = self.positional_encoding(m, feat).to(self.level_embed.dtype)
            flat.append(feat.flatten(2).transpose(1, 2))
            pos.append(p.flatten(2).transpose(1, 2) + self.level_embed[level].view(1, 1, -1))
            if m is not None:
                flat_masks.append(m.flatten(1))
                valid = (~m).float()
                ratios.append(torch.stack([valid[:, 0, :].sum(1) / w, valid[:, :, 0].sum(1) / h], -1))
        mask = torch.cat(flat_masks, 1) if masks is not None else None
        valid_ratios = torch.stack(ratios, 1) if masks is not None else feats[0].new_ones(b, len(feats), 2).float()
        return torch.cat(flat, 1), torch.cat(pos, 1), mask, shapes, valid_ratios

    def select_queries(self, memory: Tensor, mask: Tensor | None, shapes: list[tuple[int, int]]
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Two-stage query selection (DINO's "mixed"): the top ``num_queries`` encoder positions by their
        best class score give the initial boxes (detached, inverse-sigmoid) while the content queries are
        the learnt ``query_embedding``. Returns (queries, boxes, the top-k class logits and sigmoid boxes
        for the encoder loss)."""
        b, s, _ = memory.shape
        if s < self.num_queries:
            raise ConfigError(f"model.num_queries={self.num_queries} exceeds the {s} feature positions of this "
                              "input: use larger images or fewer queries")
        output_memory, proposals = self.encoder_proposals(memory, mask, shapes)
        layer = self.decoder.num_layers
        enc_cls = self.bbox_head.cls_branches[layer](output_memory)
        enc_coords = self.bbox_head.reg_branches[layer](output_memory) + proposals
        top = torch.topk(enc_cls.max(-1)[0], k=self.num_queries, dim=1)[1]
        top_cls = torch.gather(enc_cls, 1, top[..., None].expand(-1, -1, enc_cls.shape[-1]))
        top_coords = torch.gather(enc_coords, 1, top[..., None].expand(-1, -1, 4))
        # Called, not read as .weight: a module that is its own FSDP unit is gathered only in its forward.
        query = self.query_embedding(torch.arange(self.num_queries, device=memory.device))[None].expand(b, -1, -1)
        return query, top_coords.detach(), top_cls, top_coords.sigmoid()

    def encoder_proposals(self, memory: Tensor, mask: Tensor | None, shapes: list[tuple[int, int]]
                          ) -> tuple[Tensor, Tensor]:
        """A square proposal per position (width ``0.05 * 2**level``), inverse-sigmoid ``[B, S, 4]``, inf on
        padding and near the border; the memory zeroed there and passed through ``memory_trans_fc/norm``."""
        b = memory.shape[0]
        proposals, start = [], 0
        for level, (h, w) in enumerate(shapes):
            if mask is not None:
                m = mask[:, start:start + h * w].view(b, h, w)
                scale = torch.stack([(~m[:, 0, :]).sum(1), (~m[:, :, 0]).sum(1)], -1).view(b, 1, 1, 2).float()
            else:
                scale = memory.new_tensor([w, h]).float().view(1, 1, 1, 2)
            gy, gx = torch.meshgrid(torch.arange(h, dtype=torch.float32, device=memory.device),
                                    torch.arange(w, dtype=torch.float32, device=memory.device), indexing="ij")
            grid = (torch.stack([gx, gy], -1)[None].expand(b, -1, -1, -1) + 0.5) / scale
            wh = torch.full_like(grid, 0.05 * 2.0 ** level)
            proposals.append(torch.cat([grid, wh], -1).view(b, -1, 4))
            start += h * w
        proposals = torch.cat(proposals, 1)
        valid = ((proposals > 0.01) & (proposals < 0.99)).all(-1, keepdim=True)
        proposals = torch.log(proposals / (1 - proposals))
        invalid = ~valid if mask is None else (~valid) | mask[..., None]
        proposals = proposals.masked_fill(invalid, float("inf"))
        output = memory.masked_fill(invalid, 0.0)
        return self.memory_trans_norm(self.memory_trans_fc(output)), proposals

