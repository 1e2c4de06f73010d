"""Drafter checkpoints on disk: the z-lab (DFlash), DeepSpec (DSpark) and speculators (both) formats,
read by one loader (`load_drafter`, keyed by method and the config's format) and written back by
`save_dflash` / `save_dspark`. Tensors are renamed between the HF names and blockspec's fused ones
(`backbone_state`, `unfuse_state`); every mismatch is a one-line error naming the file."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from blockspec.config import ConfigError
from blockspec.drafters.backbone import DraftModel
from blockspec.drafters.config import (
    DrafterConfig,
    DSparkHeads,
    _head_type,
    _int_field,
    parse_deepspec_config,
    parse_speculators_config,
    parse_zlab_config,
)
from blockspec.drafters.dflash import DFlashDraft
from blockspec.drafters.dspark import DSparkDraft
from blockspec.errors import ModelLoadError
from blockspec.models.loader import (
    assign_weights,
    fuse_hf_layer_names,
    read_json,
    read_state_dict,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    body = [k for k in state if not k.startswith(("lm_head.", "d2t", "t2d"))]
    if body and all(k.startswith("model.") for k in body):
        return {(k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()}
    return state


def backbone_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """HF-named drafter tensors -> blockspec names (fused qkv_proj / gate_up_proj inside layers.*)."""
    layers = fuse_hf_layer_names(state, "layers.", lambda n: "layers." + n)
    rest = {k: v for k, v in state.items() if not k.startswith("layers.")}
    return {**rest, **layers}


def unfuse_state(model: nn.Module) -> dict[str, Tensor]:
    """blockspec parameter names -> the HF / reference names (q/k/v_proj, gate/up_proj)."""
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        if name.startswith("rotary."):
            continue
        t = t.detach().contiguous()
        if ".self_attn.qkv_proj." in name:
            attn = model.layers[int(name.split(".")[1])].self_attn
            parts = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for p, piece in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[name.replace("qkv_proj", p)] = piece.contiguous()
        elif ".mlp.gate_up_proj." in name:
            gate, up = t.chunk(2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = t
    return out


def _finish(model: DraftModel, state: dict[str, Tensor], source: str, device: str | torch.device,
            dtype: str | torch.dtype) -> DraftModel:
    if model.d2t is not None:
        d2t = state.pop("d2t")
        if d2t.dim() != 1 or d2t.shape[0] != model.d2t.shape[0] or d2t.dtype.is_floating_point:
            raise ModelLoadError(f"{source}: d2t must be an integer vector of draft_vocab_size "
                                 f"{model.d2t.shape[0]} entries, got {tuple(d2t.shape)} {d2t.dtype}")
        model.d2t.copy_(d2t.to(torch.int64))
        mapped = torch.arange(d2t.shape[0]) + model.d2t
        vocab = model.config.vocab_size
        if int(mapped.min()) < 0 or int(mapped.max()) >= vocab or mapped.unique().numel() != mapped.numel():
            raise ModelLoadError(f"{source}: d2t maps draft ids outside [0, {vocab}) or not one-to-one")
    assign_weights(model, state, source)
    dev = resolve_device(device)
    model.cast(dev, resolve_dtype(dtype, model.config.torch_dtype, dev))
    model.eval().requires_grad_(False)
    return model


def _build(cfg: DrafterConfig, heads: DSparkHeads | None, **kw: Any) -> DraftModel:
    """The drafter's modules (DSpark's where it has heads) built on the meta device, then given empty
    CPU tensors for the checkpoint to fill."""
    with torch.device("meta"):
        model = DFlashDraft(cfg, **kw) if heads is None else DSparkDraft(cfg, heads, **kw)
    model = model.to_empty(device="cpu")
    model.rotary = model._make_rotary("cpu")
    if model.d2t is not None:
        model.d2t = torch.zeros(model.d2t.shape[0], dtype=torch.int64)
    return model


def _speculators_vocab(state: dict[str, Tensor], cfg: DrafterConfig, source: str) -> dict[str, Any]:
    """Which vocabulary pieces a speculators checkpoint carries, checked against its config."""
    for k in ("t2d", "mask_embedding", "verifier_lm_head.weight", "verifier_norm.weight"):
        state.pop(k, None)  # training-only / placeholders
    embed = state.get("embed_tokens.weight")
    head = state.get("lm_head.weight")
    dv, tv = cfg.draft_vocab_size, cfg.vocab_size
    if head is not None and head.shape[0] != dv:
        raise ModelLoadError(f"{source}: lm_head.weight has {head.shape[0]} rows but draft_vocab_size is {dv}")
    reduced = dv is not None and dv < tv
    if reduced and head is None:
        raise ModelLoadError(f"{source}: reduced draft vocabulary (draft_vocab_size {dv} < vocab_size {tv}) needs "
                             "lm_head.weight in the checkpoint")
    if reduced and "d2t" not in state:
        raise ModelLoadError(f"{source}: reduced draft vocabulary (draft_vocab_size {dv} < vocab_size {tv}) needs "
                             "a d2t tensor in the checkpoint")
    if not reduced:
        state.pop("d2t", None)  # full vocab: identity map
    return dict(embed_rows=embed.shape[0] if embed is not None else None,
                head_rows=head.shape[0] if head is not None else None, has_d2t=reduced)


def _zlab_vocab(state: dict[str, Tensor], cfg: DrafterConfig, raw: dict[str, Any], source: str) -> dict[str, Any]:
    """z-lab checkpoints normally carry no embedding / LM head; some exports do (vLLM then keeps them)."""
    embed, head = state.get("embed_tokens.weight"), state.get("lm_head.weight")
    if embed is None and head is None:
        state.pop("d2t", None), state.pop("t2d", None)
        return {}
    state.pop("t2d", None)
    rows = head.shape[0] if head is not None else None
    declared = raw.get("draft_vocab_size")
    if rows is not None and declared is not None and declared != rows:
        raise ModelLoadError(f"{source}: lm_head.weight has {rows} rows but draft_vocab_size is {declared}")
    reduced = rows is not None and rows < cfg.vocab_size
    if reduced and "d2t" not in state:
        raise ModelLoadError(f"{source}: lm_head.weight has {rows} rows < vocab_size {cfg.vocab_size}: a reduced "
                             "draft vocabulary needs a d2t tensor")
    if not reduced:
        state.pop("d2t", None)
    return dict(embed_rows=embed.shape[0] if embed is not None else None, head_rows=rows, has_d2t=reduced)


def _check_fc(state: dict[str, Tensor], cfg: DrafterConfig, source: str) -> None:
    fc = state.get("fc.weight")
    if fc is None:
        raise ModelLoadError(f"{source}: weights do not fit the config: missing tensors: ['fc.weight']")
    want = len(cfg.target_layer_ids) * cfg.target_hidden_size
    if fc.shape[1] != want:
        raise ModelLoadError(f"{source}: fc.weight input size {fc.shape[1]} != {len(cfg.target_layer_ids)} target "
                             f"layers x target hidden size {cfg.target_hidden_size} = {want}")


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


NAMES = {"dflash": "DFlash", "dspark": "DSpark"}


def _native(method: str, raw: dict[str, Any], state: dict[str, Tensor],
            source: str) -> tuple[DrafterConfig, DSparkHeads | None, dict[str, Any], str]:
    """(config, heads, vocabulary pieces, format) of a checkpoint in its family's own format: z-lab for
    DFlash, DeepSpec for DSpark."""
    arch = raw.get("architectures") or []
    if method == "dflash":
        if any("DSpark" in a for a in arch):
            raise ModelLoadError(f"{source}: {raw['architectures']} is a DSpark checkpoint (speculative_config "
                                 "method 'dspark')")
        cfg = parse_zlab_config(raw, source)
        for old, new in (("encoder.fc.weight", "fc.weight"), ("encoder.output_norm_enc.weight", "hidden_norm.weight")):
            if old in state and new not in state:  # Muse-Glimmer "assistant" naming
                state[new] = state.pop(old)
        kw = _zlab_vocab(state, cfg, raw, source)
        if kw:
            cfg = replace(cfg, draft_vocab_size=kw["head_rows"])
        return cfg, None, kw, "zlab"
    if arch and not any("DSpark" in a for a in arch):
        dflash = " (a DFlash checkpoint: speculative_config method 'dflash')" if any("DFlash" in a for a in arch) else ""
        raise ModelLoadError(f"{source}: architectures {arch} is not a DSpark drafter (Qwen3DSparkModel){dflash}")
    cfg, heads = parse_deepspec_config(raw, source)
    state.pop("mask_embedding", None)
    embed, head = state.get("embed_tokens.weight"), state.get("lm_head.weight")
    if head is not None and head.shape[0] != cfg.vocab_size:
        raise ModelLoadError(f"{source}: lm_head.weight has {head.shape[0]} rows but vocab_size is {cfg.vocab_size}")
    kw = dict(embed_rows=embed.shape[0] if embed is not None else None,
              head_rows=head.shape[0] if head is not None else None, has_d2t=False)
    return cfg, heads, kw, "deepspec"


def _speculators(method: str, raw: dict[str, Any], state: dict[str, Tensor],
                 source: str) -> tuple[DrafterConfig, DSparkHeads | None, dict[str, Any], str]:
    """The same from a speculators checkpoint (``speculators_model_type`` dflash or dspark)."""
    kind = raw["speculators_model_type"]
    if kind != method:
        other = next((m for m in NAMES if m == kind), None)
        raise ModelLoadError(f"{source}: speculators_model_type {kind!r} is not a {NAMES[method]} drafter"
                             + (f" (speculative_config method {other!r})" if other else ""))
    cfg, _ = parse_speculators_config(raw, source, method)
    heads = _speculators_heads(raw, state, cfg, source) if method == "dspark" else None
    return cfg, heads, _speculators_vocab(state, cfg, source), "speculators"


def load_drafter(method: str, path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", use_own_embedding: bool = True,
                 use_own_head: bool = True) -> DraftModel:
    """The drafter of ``method`` (speculative_config.method: dflash or dspark) from a directory or hub
    id, in its family's format (z-lab, DeepSpec) or the speculators one. `use_own_embedding` /
    `use_own_head` False: share the target's even where the checkpoint carries its own."""
    if method not in NAMES:
        raise ConfigError(f"speculative_config.method {method!r} not supported; allowed: {tuple(NAMES)}")
    model_dir = resolve_model_dir(path_or_id, f"{NAMES[method]} drafter")
    cfg_path = model_dir / "config.json"
    raw = read_json(cfg_path)
    source = str(cfg_path)
    state = _strip_prefix(read_state_dict(model_dir))
    parse = _speculators if raw.get("speculators_model_type") is not None else _native
    cfg, heads, kw, fmt = parse(method, raw, state, source)
    state = backbone_state(state)
    _check_fc(state, cfg, source)
    model = _build(cfg, heads, **kw)
    model.source_format = fmt
    model = _finish(model, state, str(model_dir), device, dtype)
    model.recorded_acceptance = read_recorded_acceptance(model_dir, model.block_size)
    if not use_own_embedding:
        model.use_own_embedding = False
    if not use_own_head and model.lm_head is not None:
        if model.d2t is not None:
            raise ModelLoadError(f"{source}: reduced draft vocabulary: the drafter's own lm_head must be used")
        model.use_own_head = False
    return model


ACCEPTANCE_FILE = "acceptance.json"


def read_recorded_acceptance(model_dir: Path, block_size: int) -> tuple[float, ...] | None:
    """The checkpoint's measured P(first k drafts accepted), k = 1.., from its optional acceptance.json:
    where the draft-length policy starts, instead of knowing nothing about the drafter."""
    path = model_dir / ACCEPTANCE_FILE
    if not path.is_file():
        return None
    prefix = read_json(path).get("prefix_acceptance")
    if (not isinstance(prefix, list) or not 0 < len(prefix) <= block_size
            or not all(isinstance(p, (int, float)) and 0.0 <= p <= 1.0 for p in prefix)
            or any(b > a for a, b in zip(prefix, prefix[1:]))):
        raise ModelLoadError(f"{path}: prefix_acceptance must be a non-increasing list of 1 to {block_size} "
                             f"probabilities in [0, 1]")
    return tuple(float(p) for p in prefix)


def write_recorded_acceptance(model_dir: Path, prefix: list[float], measured_on: str) -> Path:
    """Record a drafter's measured acceptance beside its weights (see read_recorded_acceptance)."""
    path = Path(model_dir) / ACCEPTANCE_FILE
    path.write_text(json.dumps({"prefix_acceptance": [round(float(p), 4) for p in prefix],
                                "measured_on": measured_on}, indent=1) + "\n")
    return path


def load_dflash(path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                dtype: str | torch.dtype = "auto", use_own_head: bool = True) -> DFlashDraft:
    """A z-lab DFlash checkpoint (or a speculators ``dflash`` one)."""
    return load_drafter("dflash", path_or_id, device, dtype, use_own_head=use_own_head)


def load_dspark(path_or_id: str | os.PathLike[str], device: str | torch.device = "auto",
                dtype: str | torch.dtype = "auto", use_own_embedding: bool = True,
                use_own_head: bool = True) -> DSparkDraft:
    """A DSpark drafter: DeepSpec dense (``Qwen3DSparkModel``) or speculators ``dspark``."""
    return load_drafter("dspark", path_or_id, device, dtype, use_own_embedding, use_own_head)


# ------------------------------------------------------------------------------------------ saving
def backbone_hf_config(cfg: DrafterConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The Qwen3Config fields of the backbone (shared by all writers)."""
    rope_params: dict[str, Any] = {"rope_theta": cfg.rope.theta, "rope_type": cfg.rope.type}
    if cfg.rope.type != "default":
        rope_params.update(factor=cfg.rope.factor)
        if cfg.rope.original_max_position_embeddings is not None:
            rope_params["original_max_position_embeddings"] = cfg.rope.original_max_position_embeddings
        if cfg.rope.type == "llama3":
            rope_params.update(low_freq_factor=cfg.rope.low_freq_factor, high_freq_factor=cfg.rope.high_freq_factor)
        if cfg.rope.type == "yarn":
            rope_params.update(beta_fast=cfg.rope.beta_fast, beta_slow=cfg.rope.beta_slow)
            for name in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(cfg.rope, name) is not None:
                    rope_params[name] = getattr(cfg.rope, name)
            if not cfg.rope.truncate:
                rope_params["truncate"] = False
    dtype_name = str(dtype).replace("torch.", "") if dtype is not None else cfg.torch_dtype
    out: dict[str, Any] = {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope.theta,
        "rope_parameters": rope_params,
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": cfg.sliding_window is not None,
        "max_window_layers": cfg.num_layers,
        "dtype": dtype_name,
    }
    if cfg.rope.type != "default":
        out["rope_scaling"] = dict(rope_params)
    return out


def _write(out_dir: Path, config: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    import json

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def speculators_config(model: DraftModel, kind: str, target_vocab: int | None = None) -> dict[str, Any]:
    c = model.config
    tl = backbone_hf_config(c, model.dtype)
    draft_vocab = model.lm_head.out_features if model.lm_head is not None else (target_vocab or c.vocab_size)
    cfg: dict[str, Any] = {
        "speculators_model_type": kind,
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "transformer_layer_config": tl,
        "draft_vocab_size": draft_vocab,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sample_from_anchor": c.anchor_first,
        "sliding_window_non_causal": c.sliding_window_non_causal or (
            any(lt == "sliding_attention" for lt in c.layer_types) and not any(c.causal)),
        "target_hidden_size": c.target_hidden_size,
        "speculators_version": "0.5.0",
    }
    if c.logit_scale != 1.0:
        cfg["logit_scale"] = c.logit_scale
    return cfg


def _t2d(model: DraftModel, target_vocab: int) -> Tensor:
    """speculators' training-side target->draft membership mask (written next to d2t)."""
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[model.target_index().cpu()] = True
    return t2d


def _vocab_tensors(model: DraftModel, state: dict[str, Tensor], target: nn.Module | None,
                   need_embed: bool, need_head: bool, what: str) -> None:
    if need_embed and "embed_tokens.weight" not in state:
        if target is None:
            raise ValueError(f"{what} needs embed_tokens: the drafter has none, pass target= to copy the target's")
        state["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(model.dtype)
    if need_head and "lm_head.weight" not in state:
        if target is None:
            raise ValueError(f"{what} needs lm_head: the drafter has none, pass target= to copy the target's")
        state["lm_head.weight"] = target.lm_head.weight.detach().to(model.dtype)


def save_dflash(model: DraftModel, out_dir: str | os.PathLike[str], format: str = "zlab",
                target: nn.Module | None = None) -> Path:
    """Write `model` as a z-lab DFlash checkpoint (default) or a speculators ``dflash`` one."""
    out = Path(out_dir)
    c = model.config
    state = unfuse_state(model)
    if format == "zlab":
        if model.lm_head is not None or model.embed_tokens is not None:
            raise ValueError("save_dflash(format='zlab'): z-lab checkpoints carry no embedding/LM head; this drafter "
                             "has its own (save with format='speculators')")
        if c.anchor_first:
            raise ValueError("save_dflash(format='zlab'): z-lab DFlash is not anchor-first")
        config = backbone_hf_config(c, model.dtype)
        dflash_cfg: dict[str, Any] = {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                                      "block_size": c.block_size}
        config.update(architectures=["DFlashDraftModel"], auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                      block_size=c.block_size, dflash_config=dflash_cfg)
        if c.num_target_layers is not None:
            config["num_target_layers"] = c.num_target_layers
        default_causal = tuple(lt == "sliding_attention" for lt in c.layer_types)
        if c.causal != default_causal:
            if len(set(c.causal)) != 1:
                raise ValueError("save_dflash: per-layer causality other than 'sliding layers causal' cannot be "
                                 "expressed in the z-lab format")
            config["is_causal"] = c.causal[0]
        elif c.is_causal is not None:
            config["is_causal"] = c.is_causal
        if c.window_mode != "query" and c.sliding_window is not None:
            raise ValueError("save_dflash(format='zlab'): speculators sliding-window semantics differ from z-lab's")
        for key in ("input_embedding_scale", "output_multiplier"):
            if getattr(c, key) != 1.0:
                dflash_cfg[key] = getattr(c, key)
        if c.final_logit_softcapping:
            dflash_cfg["final_logit_softcapping"] = c.final_logit_softcapping
        state.pop("d2t", None)
        return _write(out, config, state)
    if format == "speculators":
        config = speculators_config(model, "dflash")
        _vocab_tensors(model, state, target, True, True, "save_dflash(format='speculators')")
        if model.d2t is not None:
            state["t2d"] = _t2d(model, c.vocab_size)
        return _write(out, config, state)
    raise ValueError(f"save_dflash: format {format!r} (allowed: zlab, speculators)")


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


def save_drafter(model: DraftModel, out_dir: str | os.PathLike[str], format: str | None = None,
                 target: nn.Module | None = None) -> Path:
    """Write a drafter in `format` (default: its family's own, z-lab or DeepSpec; or speculators)."""
    if isinstance(model, DSparkDraft):
        return save_dspark(model, out_dir, format or "deepspec", target)
    return save_dflash(model, out_dir, format or "zlab", target)


TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")


def _deepspec_files(drafter_dir: Path, target_dir: Path) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A DeepSpec drafter's tensors and its target's embedding and LM head (the tied embedding where the target
    has no head of its own), under the drafter's names."""
    raw = read_json(drafter_dir / "config.json")
    if raw.get("speculators_model_type") is not None or not any("DSpark" in a for a in raw.get("architectures", [])):
        raise ModelLoadError(f"{drafter_dir / 'config.json'}: not a DeepSpec DSpark checkpoint (Qwen3DSparkModel)")
    target = read_state_dict(target_dir)
    embed = target.get("model.embed_tokens.weight")
    if embed is None:
        raise ModelLoadError(f"{target_dir}: no model.embed_tokens.weight to share with the drafter")
    return read_state_dict(drafter_dir), {"embed_tokens.weight": embed,
                                          "lm_head.weight": target.get("lm_head.weight", embed)}


def strip_target_copies(drafter_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> int:
    """Drop a DeepSpec drafter's copies of its target's embedding and LM head, in place; returns the bytes saved.

    DeepSpec files carry them (the training froze them), but a copy equal to the target's is dropped at
    load anyway (`DraftModel.share_target_copies`) and a checkpoint without them takes the target's, as
    vLLM aliases them: the shipped pair is smaller by 2 x vocab x hidden values. A copy that differs
    from the target's in any element is refused by name. `restore_target_copies` undoes this."""
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    state, shared = _deepspec_files(drafter_dir, target_dir)
    saved = 0
    for name in TARGET_COPIES:
        if name not in state:
            continue
        copy = state.pop(name)
        if copy.shape != shared[name].shape or not torch.equal(copy, shared[name].to(copy.dtype)):
            raise ModelLoadError(f"{drafter_dir}: {name} differs from the target's ({target_dir}); it is the "
                                 "drafter's own and cannot be taken from the target")
        saved += copy.numel() * copy.element_size()
    if saved:
        _write(drafter_dir, read_json(drafter_dir / "config.json"), state)
    return saved


def restore_target_copies(drafter_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str],
                          out_dir: str | os.PathLike[str]) -> Path:
    """`drafter_dir` with its target's embedding and LM head written in, in the drafter's dtype, into `out_dir`:
    the DeepSpec file the reference code loads (it reads both from the drafter's own checkpoint)."""
    drafter_dir, target_dir, out = Path(drafter_dir), Path(target_dir), Path(out_dir)
    state, shared = _deepspec_files(drafter_dir, target_dir)
    dtype = next(iter(state.values())).dtype
    for name in TARGET_COPIES:
        if name not in state:  # separate storage: a tied target gives one tensor for both
            state[name] = shared[name].to(dtype).clone()
    if out.resolve() != drafter_dir.resolve():
        shutil.copytree(drafter_dir, out, dirs_exist_ok=True)
    return _write(out, read_json(drafter_dir / "config.json"), state)
