"""Build blockspec's embedded default models from the Python standard library, in one command.

    python -m blockspec.train.recipes.embedded_default --out DIR [--device cuda]
        [--target-minutes M] [--drafter-minutes M] [--tiny]

Steps: a byte-level BPE tokenizer on the stdlib sources; a small Qwen3 target LM (pretrained
here, best validation checkpoint kept); a DFlash and a DSpark drafter trained against the frozen
target; held-out perplexity and real greedy acceptance on the held-out packages (json, asyncio,
email, never seen in training); a model card per directory; each directory packed as one .tar
plus metrics.json, so that a GPU run returns at most 8 files of at most 16 MB. Every phase stops
by wall clock, so the default GPU run takes about 5 minutes. --tiny is a CPU smoke run (< 1 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import torch

from blockspec.models.loader import load_target, resolve_device
from blockspec.train.data import (
    HELDOUT_PACKAGES,
    SPECIAL_TOKENS,
    Example,
    read_texts,
    split_examples,
    stdlib_split,
    text_examples,
    train_tokenizer,
)
from blockspec.train.target_lm import LMTrainConfig, TargetShape, new_target, save_hf_target, train_target
from blockspec.train.trainer import (
    DrafterTrainConfig,
    DrafterTrainer,
    engine_acceptance,
    greedy_acceptance,
)

MAX_RETURN_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass
class RecipePlan:
    """Sizes and budgets of one recipe run (the full default, or the tiny CPU smoke test)."""

    vocab_size: int
    tokenizer_files: int | None  # None: all training files
    target: TargetShape
    seq_len: int
    target_batch: int
    target_lr: float
    target_steps: int | None
    drafter_steps: int | None
    dflash: dict[str, Any]
    dspark: dict[str, Any]
    drafter_batch: int
    corpus_files: int | None
    eval_prompts: int
    prompt_tokens: int
    new_tokens: int


def default_plan() -> RecipePlan:
    """Target ~6.8M params (13.6 MB bf16): hidden 256, 6 layers, 4 heads / 2 KV heads of 64, vocab 8192, tied."""
    taps = (1, 2, 3, 4)
    return RecipePlan(
        vocab_size=8192, tokenizer_files=None, target=TargetShape(), seq_len=512, target_batch=32, target_lr=3e-3,
        target_steps=None, drafter_steps=None,
        dflash=dict(method="dflash", num_layers=3, block_size=16, target_layer_ids=taps, lr=2e-3, num_anchors=64,
                    labels="data"),
        dspark=dict(method="dspark", num_layers=2, block_size=8, target_layer_ids=taps, markov_rank=64,
                    markov_head_type="vanilla", confidence_head=True, lr=2e-3, num_anchors=128, labels="data"),
        drafter_batch=32, corpus_files=None, eval_prompts=24, prompt_tokens=64, new_tokens=128,
    )


def tiny_plan() -> RecipePlan:
    return RecipePlan(
        vocab_size=512, tokenizer_files=30,
        target=TargetShape(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2,
                           num_kv_heads=1, head_dim=32, max_position_embeddings=512),
        seq_len=128, target_batch=8, target_lr=5e-3, target_steps=20, drafter_steps=10,
        dflash=dict(method="dflash", num_layers=1, block_size=8, target_layer_ids=(0, 1), lr=3e-3, num_anchors=16,
                    labels="target"),
        dspark=dict(method="dspark", num_layers=1, block_size=4, target_layer_ids=(0, 1), markov_rank=16,
                    markov_head_type="vanilla", confidence_head=True, lr=3e-3, num_anchors=16, labels="target"),
        drafter_batch=4, corpus_files=30, eval_prompts=2, prompt_tokens=16, new_tokens=16,
    )


def param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pack(dir_path: Path, tar_path: Path) -> int:
    """One uncompressed tar of `dir_path` (bf16 weights barely compress); returns its size."""
    with tarfile.open(tar_path, "w") as tar:
        tar.add(dir_path, arcname=dir_path.name)
    return tar_path.stat().st_size


def eval_prompts(examples: list[Example], n: int, prompt_tokens: int) -> list[list[int]]:
    """The first prompt_tokens tokens of n held-out chunks spread evenly over the held-out set."""
    if not examples:
        return []
    stride = max(1, len(examples) // n)
    return [examples[i].input_ids[:prompt_tokens] for i in range(0, len(examples), stride)][:n]


def measure_acceptance(target_dir: Path, target: Any, method: str, drafter_dir: Path, drafter: Any,
                       prompts: list[list[int]], new_tokens: int, eos: list[int], device: str) -> dict[str, Any]:
    """Greedy acceptance through blockspec's engine; the model-level reference loop checks exactness on a
    few prompts and stands in when the engine cannot run."""
    reference = greedy_acceptance(target, drafter, prompts[:4], new_tokens, eos)
    try:
        result = engine_acceptance(target_dir, method, drafter_dir, prompts, new_tokens, device)
    except Exception as exc:  # the engine is optional here; record why it was not used
        result = greedy_acceptance(target, drafter, prompts, new_tokens, eos)
        result["engine_error"] = f"{type(exc).__name__}: {exc}"[:300]
    result["reference_check"] = {k: reference[k] for k in ("mean_acceptance_length", "matches_plain_greedy")}
    result["prompts"] = len(prompts)
    result["max_new_tokens"] = new_tokens
    return result


# ---------------------------------------------------------------- model cards
def corpus_text(info: dict[str, Any]) -> str:
    return (f"The Python {info['python']} standard library sources of the interpreter that built it "
            f"({info['train_files']} `*.py` files, {info['train_tokens']:,} tokens; site-packages and test "
            f"directories excluded). The packages {', '.join(HELDOUT_PACKAGES)} ({info['heldout_files']} files, "
            f"{info['heldout_tokens']:,} tokens) are held out of every training step and used only for evaluation.")


def target_card(m: dict[str, Any]) -> str:
    t, s = m["target"], m["target"]["shape"]
    return f"""# blockspec embedded default target (Qwen3 architecture)

A small causal LM pretrained from scratch by `python -m blockspec.train.recipes.embedded_default`
so that blockspec can demonstrate speculative decoding without downloads. It writes Python-ish
code; it is not an assistant.

- **Architecture**: Qwen3 (q/k-norm, SwiGLU, GQA, RoPE theta {s['rope_theta']:g}), hidden {s['hidden_size']},
  {s['num_layers']} layers, {s['num_heads']} heads / {s['num_kv_heads']} KV heads of dim {s['head_dim']},
  MLP {s['intermediate_size']}, vocab {s['vocab_size']}, tied embeddings, max positions {s['max_position_embeddings']}.
- **Parameters**: {t['params']:,} ({t['bytes'] / 1e6:.1f} MB on disk, bf16).
- **Data**: {corpus_text(m['corpus'])}
- **Tokenizer**: byte-level BPE trained on the training files, vocab {m['tokenizer']['vocab_size']}; special tokens
  {', '.join(f'`{x}`' for x in SPECIAL_TOKENS)} (ids 0-4; `<|endoftext|>` is EOS, `<|mask|>` is the drafters'
  mask token). Decoding round-trips source text exactly.
- **Training**: {t['train']['steps']} steps of {m['plan']['target_batch']} x {m['plan']['seq_len']} tokens
  ({t['train']['epochs']} epochs, {t['train']['seconds']} s on {m['device']}), AdamW lr {m['plan']['target_lr']:g},
  warm-up + cosine, clip 1.0, bf16 autocast on GPU; weights of the best validation step kept
  (step {t['train'].get('best_step', t['train']['steps'])}). Final train loss {t['train']['final_train_loss']}.
- **Held-out perplexity** ({', '.join(HELDOUT_PACKAGES)}): {t['train'].get('heldout_perplexity')}
  (validation perplexity on training-package chunks: {t['train'].get('valid_perplexity')}).

Loads with `blockspec` (`LLM("default")`, or `LLM` given this directory) and with `transformers.AutoModelForCausalLM`.
"""


def drafter_card(m: dict[str, Any], name: str) -> str:
    d = m[name]
    c = d["config"]
    acc = d["acceptance"]
    kind = ("DFlash (z-lab format: `DFlashDraftModel`, no embedding / LM head: the target's are shared)"
            if name == "dflash" else
            "DSpark (DeepSpec format: `Qwen3DSparkModel`, anchor-first, with copies of the target's embedding and "
            f"LM head, {c['markov_head_type']} Markov head rank {c['markov_rank']}, confidence head)")
    held = d["train"].get("heldout", {})
    labels = ("the target's greedy tokens given the data prefix (what greedy verification accepts)"
              if c["labels"] == "target" else "the data tokens")
    return f"""# blockspec embedded default {name} drafter

{kind}, trained against the embedded default target (`../target`) by
`python -m blockspec.train.recipes.embedded_default`.

- **Shape**: {c['num_layers']} draft layers (hidden {d['hidden_size']}), block size {c['block_size']},
  target features from layers {list(c['target_layer_ids'])}, mask token id {d['mask_token_id']}.
- **Parameters**: {d['params']:,} trainable ({d['bytes'] / 1e6:.1f} MB on disk, bf16).
- **Data**: {corpus_text(m['corpus'])} Sequences of {m['plan']['seq_len']} tokens, {c['num_anchors']} random anchors
  per sequence; hard labels are {labels}.
- **Training**: {d['train']['steps']} steps of {m['plan']['drafter_batch']} sequences ({d['train']['seconds']} s on
  {m['device']}), AdamW lr {c['lr']:g}, warm-up + cosine, clip 1.0, loss
  {'CE with weights exp(-(k-1)/' + format(c['loss_decay_gamma'], 'g') + ')' if name == 'dflash' else
   '0.1 CE + 0.9 L1 + 1.0 BCE(confidence), weights exp(-(k-1)/' + format(c['loss_decay_gamma'], 'g') + ')'}.
  Final train loss {d['train']['final_train'].get('loss')}.
- **Held-out estimates** (teacher-forced blocks): loss {held.get('loss')}, per-position greedy match
  {held.get('acc_per_position')}, estimated acceptance length {held.get('tau_estimate')}.
- **Measured greedy acceptance** ({acc.get('path')}, {acc.get('prompts')} held-out prompts of
  {m['plan']['prompt_tokens']} tokens, {acc.get('max_new_tokens')} new tokens): mean acceptance length
  **{acc.get('mean_acceptance_length')}** tokens per target forward (bonus included); per-position acceptance
  {acc.get('acceptance_rate_per_pos')}. Output equals plain greedy decoding:
  {acc.get('reference_check', {}).get('matches_plain_greedy')}.

Use: `LLM("target", speculative_config={{"method": "{name}", "model": "{name}"}})`.
"""


# ---------------------------------------------------------------- the run
def run(out: Path, device_name: str, target_minutes: float | None, drafter_minutes: float | None, tiny: bool,
        seed: int = 0, progress: bool = True) -> dict[str, Any]:
    t_start = time.monotonic()
    plan = tiny_plan() if tiny else default_plan()
    device = resolve_device(device_name)
    threads = torch.get_num_threads()
    if tiny and device.type == "cpu":
        # tiny shapes gain nothing from intra-op threads, and on a busy machine spinning threads
        # slow every op by 10x or more
        torch.set_num_threads(1)
    try:
        return _run(out, plan, device, target_minutes, drafter_minutes, tiny, seed, progress, t_start)
    finally:
        torch.set_num_threads(threads)


def _run(out: Path, plan: RecipePlan, device: torch.device, target_minutes: float | None,
         drafter_minutes: float | None, tiny: bool, seed: int, progress: bool, t_start: float) -> dict[str, Any]:
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        timings[name] = round(time.monotonic() - since, 1)
        return time.monotonic()

    # ---- corpus and tokenizer
    t = time.monotonic()
    split = stdlib_split()
    train_files = split.train[: plan.corpus_files] if plan.corpus_files else split.train
    train_texts = read_texts(train_files)
    held_files = split.heldout[: 6 if tiny else None]
    held_texts = read_texts(held_files)
    tokenizer = train_tokenizer(train_texts[: plan.tokenizer_files] if plan.tokenizer_files else train_texts,
                                vocab_size=plan.vocab_size, max_len=plan.target.max_position_embeddings)
    t = lap("tokenizer", t)
    examples = text_examples(train_texts, tokenizer, plan.seq_len)
    heldout = text_examples(held_texts, tokenizer, plan.seq_len)
    train_ex, valid_ex = split_examples(examples, 0.02, seed)
    valid_ex = valid_ex[:64]
    corpus = {"python": platform.python_version(), "train_files": len(train_files),
              "train_tokens": sum(len(e.input_ids) for e in examples), "heldout_files": len(held_files),
              "heldout_tokens": sum(len(e.input_ids) for e in heldout)}
    t = lap("tokenize", t)

    # ---- target LM
    shape = dataclasses.replace(plan.target, vocab_size=len(tokenizer))
    model = new_target(shape.model_config(tokenizer.eos_token_id), seed)
    lm_cfg = LMTrainConfig(seq_len=plan.seq_len, batch_size=plan.target_batch, lr=plan.target_lr,
                           max_steps=plan.target_steps, max_minutes=None if tiny else target_minutes,
                           eval_every=10 if tiny else 200, seed=seed, device=str(device), progress=progress)
    lm_metrics = train_target(model, train_ex, heldout, lm_cfg, tokenizer.pad_token_id, valid_ex)
    target_dir = save_hf_target(model, out / "target", tokenizer, dtype="bfloat16")
    del model
    t = lap("target", t)
    target, _ = load_target(target_dir, dtype="auto", device=device)  # exactly what the engine will serve
    target_info = {"shape": dataclasses.asdict(shape), "params": param_count(target), "bytes": dir_bytes(target_dir),
                   "train": lm_metrics}

    # ---- drafters
    metrics: dict[str, Any] = {"plan": dataclasses.asdict(plan), "device": str(device), "corpus": corpus,
                               "tokenizer": {"vocab_size": len(tokenizer), "special_tokens": list(SPECIAL_TOKENS)},
                               "target": target_info}
    prompts = eval_prompts(heldout, plan.eval_prompts, plan.prompt_tokens)
    eos = [tokenizer.eos_token_id]
    for name, spec in (("dflash", plan.dflash), ("dspark", plan.dspark)):
        cfg = DrafterTrainConfig(**spec, max_len=plan.seq_len, batch_size=plan.drafter_batch,
                                 max_steps=plan.drafter_steps,
                                 max_minutes=None if tiny else drafter_minutes, eval_batches=4 if tiny else 16,
                                 seed=seed, device=str(device), progress=progress)
        trainer = DrafterTrainer(target, train_ex, cfg, tokenizer.mask_token_id, tokenizer.pad_token_id, heldout)
        train_metrics = trainer.fit()
        drafter_dir = trainer.export(out / name)
        t = lap(f"{name}_train", t)
        drafter = trainer.drafter.cast(device, target.embed_tokens.weight.dtype).eval().requires_grad_(False)
        acceptance = measure_acceptance(target_dir, target, name, drafter_dir, drafter, prompts, plan.new_tokens,
                                        eos, str(device))
        t = lap(f"{name}_acceptance", t)
        metrics[name] = {"config": dataclasses.asdict(cfg), "params": param_count(trainer.drafter),
                         "hidden_size": trainer.drafter.config.hidden_size,
                         "mask_token_id": trainer.drafter.mask_token_id, "bytes": dir_bytes(drafter_dir),
                         "train": train_metrics, "acceptance": acceptance}
        del trainer, drafter

    # ---- cards, metrics, tars
    (target_dir / "README.md").write_text(target_card(metrics))
    for name in ("dflash", "dspark"):
        (out / name / "README.md").write_text(drafter_card(metrics, name))
    tars = {}
    for name in ("target", "dflash", "dspark"):
        size = pack(out / name, out / f"{name}.tar")
        tars[f"{name}.tar"] = size
        if size > MAX_RETURN_BYTES:
            print(f"warning: {name}.tar is {size / 2**20:.1f} MiB, over the 16 MiB return limit", file=sys.stderr)
    metrics["tars"] = tars
    timings["total"] = round(time.monotonic() - t_start, 1)
    metrics["timings_s"] = timings
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m blockspec.train.recipes.embedded_default",
                                description="Build the embedded default tokenizer, target, DFlash and DSpark drafters.")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    # Both models overfit the ~2.5M-token corpus within minutes. The target keeps its best validation
    # step; the drafters' held-out acceptance fell when trained longer (benchmarks/RESULTS.md: 0.7 min
    # with data labels gave 1.92 / 2.49, 2-2.5 min with target labels or regenerated text gave less),
    # so these defaults are the budgets of the shipped pair.
    p.add_argument("--target-minutes", type=float, default=2.4, help="wall-clock budget of target pretraining")
    p.add_argument("--drafter-minutes", type=float, default=0.7, help="wall-clock budget of each drafter")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with tiny sizes (< 1 minute)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    metrics = run(args.out, args.device, args.target_minutes, args.drafter_minutes, args.tiny, args.seed,
                  args.progress)
    summary = {
        "heldout_perplexity": metrics["target"]["train"].get("heldout_perplexity"),
        **{f"{n}_acceptance_length": metrics[n]["acceptance"]["mean_acceptance_length"] for n in ("dflash", "dspark")},
        "tars": metrics["tars"], "timings_s": metrics["timings_s"],
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
