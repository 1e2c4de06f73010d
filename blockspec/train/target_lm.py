"""Pretrain a small Qwen3-architecture target LM with blockspec's own CausalLM and save it as a HF directory.

The saved directory is an ordinary transformers checkpoint (Qwen3ForCausalLM names, un-fused
q/k/v and gate/up projections under `model.`), so the same files load in blockspec and in
transformers, and the demo target behaves like any hub model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ModelConfig, RopeConfig
from blockspec.models.kv_cache import dense_causal_meta
from blockspec.models.llama import CausalLM
from blockspec.models.loader import resolve_device
from blockspec.train.data import Batches, Example, collate
from blockspec.train.trainer import CosineSchedule, StepBudget, autocast, make_optimizer, progress_bar


@dataclass
class TargetShape:
    """Architecture of the pretrained target (Qwen3: q/k-norm, SwiGLU, GQA, RoPE)."""

    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    def model_config(self, eos_id: int, bos_id: int | None = None) -> ModelConfig:
        return ModelConfig(
            model_type="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rope=RopeConfig(theta=self.rope_theta), max_position_embeddings=self.max_position_embeddings,
            qk_norm=True, tie_word_embeddings=self.tie_word_embeddings,
            layer_types=("full_attention",) * self.num_layers, torch_dtype="bfloat16",
            eos_token_ids=(eos_id,), bos_token_id=bos_id,
        )


@dataclass
class LMTrainConfig:
    """Optimisation of the target LM. Training stops at max_steps or max_minutes, whichever comes first."""

    seq_len: int = 512
    batch_size: int = 32
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_frac: float = 0.03
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: int | None = 2000
    max_minutes: float | None = None
    eval_batch_size: int = 16
    eval_every: int = 0  # validate every N steps and keep the best weights (0: keep the last)
    seed: int = 0
    device: str = "auto"
    progress: bool = True


def new_target(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """A freshly initialised CausalLM: N(0, 0.02) weights, residual outputs scaled by 1/sqrt(2 * layers)."""
    model = CausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            nn.init.normal_(p, 0.0, std, generator=gen)
        elif "norm" in name:
            nn.init.ones_(p)
        else:
            nn.init.zeros_(p)
    return model


def lm_nll(model: CausalLM, input_ids: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Summed next-token NLL over positions whose *label* has loss_mask 1, and the number of such positions."""
    b, s = input_ids.shape
    meta = dense_causal_meta(b, s - 1, input_ids.device)
    hidden, _ = model(input_ids[:, :-1], meta, None)
    logits = model.compute_logits(hidden)
    labels = input_ids[:, 1:]
    weight = loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (nll * weight.reshape(-1)).sum(), weight.sum()


@torch.no_grad()
def perplexity(model: CausalLM, examples: list[Example], pad_id: int, batch_size: int = 16,
               device: torch.device | None = None) -> float:
    """exp(mean NLL) over the loss tokens of `examples`."""
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = count = 0.0
    for i in range(0, len(examples), batch_size):
        ids, mask = collate(examples[i : i + batch_size], pad_id)
        with autocast(device):
            nll, n = lm_nll(model, ids.to(device), mask.to(device))
        total += float(nll)
        count += float(n)
    model.train(was_training)
    return math.exp(total / max(count, 1.0))


def lm_step(model: CausalLM, opt: torch.optim.Optimizer, schedule: CosineSchedule, ids: Tensor, mask: Tensor,
            grad_clip: float) -> Tensor:
    """One optimiser step on a batch (mean next-token NLL over supervised labels, clipped gradients, bf16
    autocast on CUDA); the schedule advances by one. Returns the detached loss."""
    with autocast(ids.device):
        nll, n = lm_nll(model, ids, mask)
        loss = nll / n.clamp(min=1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    schedule.step()
    return loss.detach()


def train_target(model: CausalLM, train: list[Example], heldout: list[Example], cfg: LMTrainConfig,
                 pad_id: int, valid: list[Example] | None = None) -> dict[str, Any]:
    """Pretrain `model` in place (AdamW, warm-up + cosine, clipping, bf16 autocast on CUDA); return metrics.

    With `valid` and cfg.eval_every, the weights with the best validation perplexity are kept: a
    small model on a small corpus overfits after enough epochs. `heldout` is only reported.
    """
    device = resolve_device(cfg.device)
    model.to(device).train()
    opt = make_optimizer(model, cfg.lr, cfg.weight_decay)
    schedule = CosineSchedule(opt, cfg.warmup_frac, cfg.min_lr_ratio)
    batches = Batches(train, cfg.batch_size, pad_id, cfg.seed)
    budget = StepBudget(cfg.max_steps, cfg.max_minutes * 60 if cfg.max_minutes else None)
    bar = progress_bar(budget.total if budget.calibrated else None, "target LM", cfg.progress)
    step = 0
    loss_ema = None
    best: tuple[float, int, dict[str, Tensor]] | None = None
    while not budget.done(step):
        ids, mask = (t.to(device, non_blocking=True) for t in next(batches))
        schedule.plan(budget.total, step)
        lr = schedule.lr()
        loss = lm_step(model, opt, schedule, ids, mask, cfg.grad_clip)
        step += 1
        budget.after_step(step)
        if step % 10 == 0 or budget.done(step):
            value = float(loss.detach())
            loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
            if bar is not None:
                if bar.total != budget.total and budget.calibrated:
                    bar.total = budget.total
                bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}")
        if bar is not None:
            bar.update(1)
        if valid and cfg.eval_every and (step % cfg.eval_every == 0 or budget.done(step)):
            ppl = perplexity(model, valid, pad_id, cfg.eval_batch_size, device)
            if best is None or ppl < best[0]:
                best = (ppl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    if bar is not None:
        bar.close()
    model.eval()
    metrics: dict[str, Any] = {
        "steps": step,
        "seconds": round(budget.elapsed(), 1),
        "tokens_seen": step * batches.batch_size * cfg.seq_len,
        "final_train_loss": round(loss_ema, 4) if loss_ema is not None else None,
        "epochs": round(batches.epoch + batches.pos / max(1, len(train)), 2),
    }
    if best is not None:
        model.load_state_dict(best[2])
        metrics.update(valid_perplexity=round(best[0], 3), best_step=best[1])
    if heldout:
        metrics["heldout_perplexity"] = round(perplexity(model, heldout, pad_id, cfg.eval_batch_size, device), 3)
    return metrics


# ---------------------------------------------------------------- HF export
def hf_state_dict(model: CausalLM, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """blockspec weights under transformers' names: fused projections split, `model.` prefix, tied head dropped."""
    cfg = model.config
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", dtype or t.dtype)
        if name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[name] = t.clone()
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv], dim=0)):
                out["model." + name.replace("qkv_proj", part)] = piece.clone()
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.split(cfg.intermediate_size, dim=0)):
                out["model." + name.replace("gate_up_proj", part)] = piece.clone()
        else:
            out["model." + name] = t.clone()
    return out


def save_hf_target(model: CausalLM, out_dir: str | Path, tokenizer: Any = None, dtype: str = "bfloat16",
                   extra_config: dict[str, Any] | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write config.json, model.safetensors, generation_config.json (and the tokenizer) to `out_dir`.

    With max_shard_bytes the weights are split as transformers splits them (model-0000i-of-0000n.safetensors
    and model.safetensors.index.json), each shard at most that size, so a GPU call can return them.
    """
    from blockspec.train.data import save_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(model.config, torch_dtype=dtype)
    hf = cfg.to_hf()
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    if tokenizer is not None and tokenizer.pad_token_id is not None:
        hf["pad_token_id"] = tokenizer.pad_token_id
    hf.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_weights(hf_state_dict(model, torch_dtype), out, max_shard_bytes)
    gen: dict[str, Any] = {"eos_token_id": hf.get("eos_token_id")}
    if "pad_token_id" in hf:
        gen["pad_token_id"] = hf["pad_token_id"]
    if cfg.bos_token_id is not None:
        gen["bos_token_id"] = cfg.bos_token_id
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def save_weights(state: dict[str, Tensor], out: Path, max_shard_bytes: int | None = None) -> list[Path]:
    """model.safetensors, or transformers' sharded layout when the weights exceed max_shard_bytes."""
    from safetensors.torch import save_file

    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    groups: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        if max_shard_bytes is not None and t.nbytes > max_shard_bytes - (1 << 16):
            raise ValueError(f"{name}: {t.nbytes} bytes do not fit a shard of {max_shard_bytes} bytes")
        if max_shard_bytes is not None and groups[-1] and size + t.nbytes > max_shard_bytes - (1 << 16):
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += t.nbytes
    if len(groups) == 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        return [out / "model.safetensors"]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(group, str(out / name), metadata={"format": "pt"})
        files.append(out / name)
        weight_map.update(dict.fromkeys(group, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files
