"""DSpark drafter: the DFlash backbone (anchor-first) plus the sequential Markov head and the confidence head.

Formulas (DeepSpec ``deepspec/modeling/dspark/markov_head.py`` and ``common.py``; speculators
``models/dspark/model_definitions.py`` computes the same with a draft-vocabulary W2):

* Markov bias at draft position k, previous token x_{k-1} (x_0 = anchor, a TARGET-vocab id),
  e = W1[x_{k-1}] (``markov_w1``, an embedding over the target vocabulary):
    - vanilla: B_k = W2 e
    - gated:   g = sigmoid(gate_proj([h_k ; e])),  B_k = W2 (g * e)
    - rnn:     [g; c; o] = joint_proj([s_{k-1} ; e ; h_k]),  s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c),
               B_k = W2 tanh(o),  s_0 = 0
  ``markov_w2`` maps rank r to the draft vocabulary (the target's, or a reduced one with ``d2t``).
* Draft distribution: p_k = softmax(U_k + B_k), U_k = lm_head(h_k); drafted left to right.
* Confidence: c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b) (h_k only without ``confidence_head_with_markov``).

``markov_step`` and ``confidence`` are the single source of these formulas; ``draft_greedy`` and the
engine's sampled path both call them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.models.loader import read_json, read_state_dict, resolve_model_dir
from blockspec.errors import ModelLoadError
from blockspec.spec.drafter import (
    DrafterConfig,
    DraftModel,
    _arch_fields,
    _build,
    _check_fc,
    _finish,
    _int_field,
    _layer_ids,
    _speculators_vocab,
    _strip_prefix,
    _t2d,
    _vocab_tensors,
    _write,
    backbone_hf_config,
    backbone_state,
    parse_speculators_config,
    speculators_config,
    unfuse_state,
)

__all__ = ["DSparkHeads", "DSparkDraft", "MarkovHead", "ConfidenceHead", "load_dspark", "save_dspark"]

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkHeads:
    markov_rank: int = 256
    markov_head_type: str | None = "vanilla"  # None when markov_rank == 0
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    num_anchors: int = 512  # DeepSpec training field, kept for writing checkpoints back

    def __post_init__(self) -> None:
        if self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be >= 0, got {self.markov_rank}")
        if self.markov_rank > 0 and self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ConfigError(f"markov_head_type {self.markov_head_type!r} unknown; allowed: {MARKOV_HEAD_TYPES}")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError("confidence_head_with_markov=true needs markov_rank > 0")


class MarkovHead(nn.Module):
    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, head_type: str) -> None:
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def latent(self, h_k: Tensor, prev_ids: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The rank-r vector W2 is applied to, and the new recurrent state (rnn only)."""
        e = self.markov_w1(prev_ids.long())
        if self.head_type == "vanilla":
            return e, None
        h_k = h_k.to(e.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h_k, e], dim=-1)))
            return gate.to(e.dtype) * e, None
        if state is None:
            state = torch.zeros_like(e)
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, e, h_k], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), new_state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDraft(DraftModel):
    """DSpark drafter (DeepSpec ``Qwen3DSparkModel`` or speculators ``dspark``)."""

    source_format = "deepspec"

    def __init__(self, cfg: DrafterConfig, heads: DSparkHeads, embed_rows: int | None = None,
                 head_rows: int | None = None, has_d2t: bool = False) -> None:
        super().__init__(cfg, embed_rows=embed_rows, head_rows=head_rows, has_d2t=has_d2t)
        self.heads = heads
        draft_vocab = head_rows or cfg.vocab_size
        self.markov_head = (MarkovHead(cfg.vocab_size, draft_vocab, heads.markov_rank, cfg.hidden_size,
                                       heads.markov_head_type) if heads.markov_rank > 0 else None)
        self.confidence_head = None
        if heads.enable_confidence_head:
            dim = cfg.hidden_size + (heads.markov_rank if heads.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim)

    # ------------------------------------------------------------------ checks
    def check_target(self, target_cfg: ModelConfig) -> None:
        super().check_target(target_cfg)
        last = target_cfg.num_hidden_layers - 1
        if last in self.target_layer_ids:
            raise ConfigError(
                f"DSparkDraft: target_layer_ids {list(self.target_layer_ids)} include the target's last layer {last}; "
                "DSpark is trained on raw decoder-layer outputs and HF's last hidden state is post-norm "
                "(DeepSpec assert_no_final_target_layer)")
        if self.markov_head is not None and self.markov_head.markov_w1.num_embeddings != target_cfg.vocab_size:
            raise ConfigError(f"DSparkDraft: markov_w1 has {self.markov_head.markov_w1.num_embeddings} rows but the "
                              f"target vocab_size is {target_cfg.vocab_size} (W1 is indexed by target token ids)")

    def _check_vocab(self, target_cfg: ModelConfig) -> None:
        if self.use_own_head:
            super()._check_vocab(target_cfg)
            return
        # shared target head: the Markov bias must cover the target vocabulary
        if self.markov_head is not None and self.markov_head.markov_w2.out_features != target_cfg.vocab_size:
            raise ConfigError(f"DSparkDraft: markov_w2 has {self.markov_head.markov_w2.out_features} rows but the "
                              f"shared target LM head has vocab_size {target_cfg.vocab_size}")
        super()._check_vocab(target_cfg)

    # ------------------------------------------------------------------ heads
    @property
    def markov_head_type(self) -> str | None:
        return self.markov_head.head_type if self.markov_head is not None else None

    def markov_step(self, k: int, h_k: Tensor, prev_ids: Tensor, state: Tensor | None) -> tuple[Tensor | None,
                                                                                                  Tensor | None]:
        """Markov bias for draft position k (0-based): ([R, V_draft] fp32 or None without a head, new state)."""
        del k  # every DeepSpec head is position-agnostic; kept in the signature for future heads
        if self.markov_head is None:
            return None, None
        latent, state = self.markov_head.latent(h_k, prev_ids, state)
        bias = self.markov_head.markov_w2(latent).float()
        if self.config.logit_scale != 1.0:
            bias = bias * self.config.logit_scale
        return bias, state

    def markov_bias_at(self, latent: Tensor, columns: Tensor) -> Tensor:
        """W2 rows `columns` [R, k] applied to `latent` [R, r]: the bias restricted to those draft columns."""
        w = self.markov_head.markov_w2.weight[columns]  # [R, k, r]
        bias = torch.bmm(w, latent.to(w.dtype).unsqueeze(-1)).squeeze(-1).float()
        return bias * self.config.logit_scale if self.config.logit_scale != 1.0 else bias

    def confidence(self, h_k: Tensor, prev_ids: Tensor | None = None, logits: bool = False) -> Tensor:
        """c_k = sigmoid(w^T [h_k ; W1[prev]] + b), [R] fp32 (the pre-sigmoid logit with logits=True)."""
        if self.confidence_head is None:
            raise ValueError("DSparkDraft.confidence: this checkpoint has no confidence head")
        if self.heads.confidence_head_with_markov:
            if prev_ids is None:
                raise ValueError("DSparkDraft.confidence: prev_ids needed (confidence_head_with_markov)")
            e = self.markov_head.markov_w1(prev_ids.long())
            features = torch.cat([h_k, e.to(h_k.dtype)], dim=-1)
        else:
            features = h_k
        proj = self.confidence_head.proj
        out = F.linear(features.float(), proj.weight.float(), proj.bias.float()).squeeze(-1)
        return out if logits else torch.sigmoid(out)

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    def draft_greedy(self, base_logits: Tensor, h: Tensor, anchor_ids: Tensor,
                     top_k: int = 0) -> tuple[Tensor, Tensor | None]:
        """Sequential argmax drafting: logits_k = U_k + B_k(prev), token = argmax, prev = token.

        base_logits [R, K, V_draft] (``logits``), h [R, K, H] (``slot_hidden``), anchor_ids [R] target ids.
        Returns (tokens [R, K] target ids, confidences [R, K] or None). With top_k > 0 only the top_k
        columns of U_k are candidates and the bias is computed for those only.
        """
        r, k_total, v = base_logits.shape
        prev = anchor_ids.long()
        state = None
        tokens, confs = [], []
        use_topk = self.markov_head is not None and 0 < top_k < v
        for k in range(k_total):
            h_k = h[:, k]
            if self.confidence_head is not None:
                confs.append(self.confidence(h_k, prev))
            base_k = base_logits[:, k].float()
            if self.markov_head is None:
                draft = base_k.argmax(dim=-1)
            elif use_topk:
                values, columns = base_k.topk(top_k, dim=-1)
                latent, state = self.markov_head.latent(h_k, prev, state)
                scores = values + self.markov_bias_at(latent, columns)
                draft = columns.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
            else:
                bias, state = self.markov_step(k, h_k, prev, state)
                draft = (base_k + bias).argmax(dim=-1)
            prev = self.draft_to_target(draft)
            tokens.append(prev)
        toks = torch.stack(tokens, dim=1) if tokens else base_logits.new_zeros((r, 0), dtype=torch.int64)
        conf = torch.stack(confs, dim=1) if confs else None
        return toks, conf


# ----------------------------------------------------------------------------------------- loading
def _bool_field(raw: dict[str, Any], name: str, source: str, default: bool | None = None) -> bool:
    value = raw.get(name, default)
    if value is None:
        raise ModelLoadError(f"{source}: missing required field {name!r}")
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: field {name!r} must be true or false, got {value!r}")
    return value


def _head_type(value: Any, source: str) -> str:
    if value is None:
        raise ModelLoadError(f"{source}: missing required field 'markov_head_type' (markov_rank > 0)")
    if str(value).lower() not in MARKOV_HEAD_TYPES:
        raise ModelLoadError(f"{source}: unknown markov_head_type {value!r}; allowed: {', '.join(MARKOV_HEAD_TYPES)}")
    return str(value).lower()


def parse_deepspec_config(raw: dict[str, Any], source: str) -> tuple[DrafterConfig, DSparkHeads]:
    arch = raw.get("architectures") or []
    if any("Gemma4" in a for a in arch):
        raise ModelLoadError(f"{source}: {arch} (Gemma4 DSpark) is not supported; Qwen3DSparkModel only")
    fields = _arch_fields(raw, source)
    block = _int_field(raw.get("block_size"), "block_size", source, 1) if "block_size" in raw else None
    if block is None:
        raise ModelLoadError(f"{source}: missing required field 'block_size'")
    if raw.get("mask_token_id") is None:
        raise ModelLoadError(f"{source}: missing required field 'mask_token_id'")
    mask = _int_field(raw["mask_token_id"], "mask_token_id", source)
    if raw.get("target_layer_ids") is None:
        raise ModelLoadError(f"{source}: missing required field 'target_layer_ids'")
    ids = _layer_ids(raw["target_layer_ids"], "target_layer_ids", source)
    if any(i < -1 for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ModelLoadError(f"{source}: target_layer_ids {list(ids)} must be strictly increasing, each -1 "
                             "(embeddings) or a decoder layer index")
    if raw.get("markov_rank") is None:
        raise ModelLoadError(f"{source}: missing required field 'markov_rank'")
    rank = _int_field(raw["markov_rank"], "markov_rank", source)
    head_type = _head_type(raw.get("markov_head_type"), source) if rank > 0 else None
    conf = _bool_field(raw, "enable_confidence_head", source)
    with_markov = _bool_field(raw, "confidence_head_with_markov", source) if conf else False
    if conf and with_markov and rank == 0:
        raise ModelLoadError(f"{source}: confidence_head_with_markov=true needs markov_rank > 0")
    cfg = DrafterConfig(
        **fields, block_size=block, mask_token_id=mask, target_layer_ids=ids, target_hidden_size=fields["hidden_size"],
        causal=(False,) * fields["num_layers"], window_mode="query", anchor_first=True,
        num_target_layers=raw.get("num_target_layers"),
    )
    heads = DSparkHeads(rank, head_type, conf, with_markov, int(raw.get("num_anchors") or 512))
    return cfg, heads


def _speculators_heads(raw: dict[str, Any], state: dict[str, Tensor], cfg: DrafterConfig, source: str) -> DSparkHeads:
    """Head settings from the config, or inferred from the weights where the config is silent; must agree."""
    w1 = state.get("markov_head.markov_w1.weight")
    rank = raw.get("markov_rank")
    if rank is None:
        rank = w1.shape[1] if w1 is not None else 0
    rank = _int_field(rank, "markov_rank", source)
    head_type = None
    if rank > 0:
        inferred = ("gated" if "markov_head.gate_proj.weight" in state else
                    "rnn" if "markov_head.joint_proj.weight" in state else "vanilla")
        head_type = _head_type(raw.get("markov_head_type", inferred), source)
    proj = state.get("confidence_head.proj.weight")
    conf = raw.get("enable_confidence_head")
    conf = proj is not None if conf is None else conf
    if not isinstance(conf, bool):
        raise ModelLoadError(f"{source}: field 'enable_confidence_head' must be true or false, got {conf!r}")
    with_markov = raw.get("confidence_head_with_markov")
    if with_markov is None:
        with_markov = bool(proj is not None and proj.shape[1] == cfg.hidden_size + rank and rank > 0)
    if not isinstance(with_markov, bool):
        raise ModelLoadError(f"{source}: field 'confidence_head_with_markov' must be true or false")
    if not conf:
        with_markov = False
    if conf and with_markov and rank == 0:
        raise ModelLoadError(f"{source}: confidence_head_with_markov=true needs markov_rank > 0")
    return DSparkHeads(rank, head_type, conf, with_markov)


def load_dspark(path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                dtype: str | torch.dtype = "auto", use_own_embedding: bool = True,
                use_own_head: bool = True) -> DSparkDraft:
    """Load a DSpark drafter: DeepSpec dense (``Qwen3DSparkModel``) or speculators ``dspark``."""
    model_dir = resolve_model_dir(path_or_id, "DSpark drafter")
    cfg_path = model_dir / "config.json"
    raw = read_json(cfg_path)
    source = str(cfg_path)
    state = _strip_prefix(read_state_dict(model_dir))
    spec_type = raw.get("speculators_model_type")
    if spec_type is not None:
        if spec_type != "dspark":
            raise ModelLoadError(f"{source}: speculators_model_type {spec_type!r} is not a DSpark drafter"
                                 + (" (use load_dflash)" if spec_type == "dflash" else ""))
        cfg, _ = parse_speculators_config(raw, source, "dspark")
        heads = _speculators_heads(raw, state, cfg, source)
        kw = _speculators_vocab(state, cfg, source)
        fmt = "speculators"
    else:
        arch = raw.get("architectures") or []
        if arch and not any("DSpark" in a for a in arch):
            raise ModelLoadError(f"{source}: architectures {arch} is not a DSpark drafter (Qwen3DSparkModel)")
        cfg, heads = parse_deepspec_config(raw, source)
        state.pop("mask_embedding", None)
        embed, head = state.get("embed_tokens.weight"), state.get("lm_head.weight")
        if head is not None and head.shape[0] != cfg.vocab_size:
            raise ModelLoadError(f"{source}: lm_head.weight has {head.shape[0]} rows but vocab_size is "
                                 f"{cfg.vocab_size}")
        kw = dict(embed_rows=embed.shape[0] if embed is not None else None,
                  head_rows=head.shape[0] if head is not None else None, has_d2t=False)
        fmt = "deepspec"
    state = backbone_state(state)
    _check_fc(state, cfg, source)
    model = _build(_DSparkFactory(heads), cfg, **kw)
    model.source_format = fmt
    model = _finish(model, state, str(model_dir), device, dtype)
    if not use_own_embedding:
        model.use_own_embedding = False
    if not use_own_head and model.lm_head is not None:
        if model.d2t is not None:
            raise ModelLoadError(f"{source}: reduced draft vocabulary: the drafter's own lm_head must be used")
        model.use_own_head = False
    return model


class _DSparkFactory:
    """Adapter so drafter._build (cls(cfg, **kw)) can build a DSparkDraft with its heads."""

    def __init__(self, heads: DSparkHeads) -> None:
        self.heads = heads

    def __call__(self, cfg: DrafterConfig, **kw: Any) -> DSparkDraft:
        return DSparkDraft(cfg, self.heads, **kw)


# ------------------------------------------------------------------------------------------ saving
def save_dspark(model: DSparkDraft, out_dir: str | os.PathLike[str], format: str = "deepspec",
                target: nn.Module | None = None) -> Path:
    """Write `model` as a DeepSpec dense checkpoint (default) or a speculators ``dspark`` one.

    DeepSpec files always carry ``embed_tokens`` and ``lm_head``; a drafter without its own copies
    needs ``target=`` to take them from.
    """
    out = Path(out_dir)
    c, h = model.config, model.heads
    state = unfuse_state(model)
    fields: dict[str, Any] = {
        "markov_rank": h.markov_rank,
        "enable_confidence_head": h.enable_confidence_head,
    }
    if h.markov_rank > 0:
        fields["markov_head_type"] = h.markov_head_type
    if h.enable_confidence_head:
        fields["confidence_head_with_markov"] = h.confidence_head_with_markov
    if format == "deepspec":
        if not c.anchor_first:
            raise ValueError("save_dspark(format='deepspec'): DeepSpec DSpark is anchor-first")
        if model.d2t is not None or (model.lm_head is not None and model.lm_head.out_features != c.vocab_size):
            raise ValueError("save_dspark(format='deepspec'): DeepSpec has no reduced draft vocabulary "
                             "(save with format='speculators')")
        if c.sliding_window is not None or any(c.causal):
            raise ValueError("save_dspark(format='deepspec'): DeepSpec drafters are full, non-causal attention")
        _vocab_tensors(model, state, target, True, True, "save_dspark(format='deepspec')")
        config = backbone_hf_config(c, model.dtype)
        config.update(architectures=["Qwen3DSparkModel"], block_size=c.block_size, mask_token_id=c.mask_token_id,
                      target_layer_ids=list(c.target_layer_ids), num_anchors=h.num_anchors, **fields)
        if c.num_target_layers is not None:
            config["num_target_layers"] = c.num_target_layers
        return _write(out, config, state)
    if format == "speculators":
        config = speculators_config(model, "dspark")
        config.update(fields)
        config["enable_confidence_head"] = h.enable_confidence_head
        config["confidence_head_with_markov"] = h.confidence_head_with_markov
        _vocab_tensors(model, state, target, True, True, "save_dspark(format='speculators')")
        if model.d2t is not None:
            state["t2d"] = _t2d(model, c.vocab_size)
        return _write(out, config, state)
    raise ValueError(f"save_dspark: format {format!r} (allowed: deepspec, speculators)")
