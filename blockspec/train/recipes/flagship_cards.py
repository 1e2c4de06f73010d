"""The shipped flagship pair from a finished run directory: its exports, model cards and metrics.json.

Everything a card states is read from the run's own records (the corpus manifest, the target's and
drafters' state indexes, the last regeneration metrics), so a card cannot drift from what was trained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open

from blockspec.drafters import load_drafter, strip_target_copies
from blockspec.drafters.config import DrafterConfig
from blockspec.models.fp8_export import write_fp8_checkpoint
from blockspec.train.drafter_stage import DrafterStageConfig, export_best
from blockspec.train.state import read_index

PAIR = ("target", "dflash", "dspark")


def _params(model_dir: Path) -> int:
    """The model's parameters (an FP8 checkpoint's weight scales are not among them)."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("_scale_inv"))


def _pair_bytes(pair: Path) -> int:
    """Bytes of the shipped pair's files, metrics.json (which records this) aside."""
    return sum(f.stat().st_size for f in pair.rglob("*") if f.is_file() and f.name != "metrics.json")


def run_record(run_dir: Path, states: dict[str, str] | None = None) -> dict[str, Any]:
    """What the run did, from its records: corpus, target training, regeneration, each drafter's best (from
    run_dir/<method>-state, or the state directory `states` names for the method)."""
    manifest = json.loads((run_dir / "corpus" / "manifest.json").read_text())
    target_run = read_index(run_dir / "target-state")["state"]["run"]
    regen = json.loads((run_dir / "regen" / "regen_metrics.json").read_text())
    drafters = {m: drafter_record(run_dir / (states or {}).get(m, f"{m}-state")) for m in PAIR[1:]}
    train = manifest["splits"]["train"]
    return {
        "corpus": {"train_files": train["files"], "train_tokens": train["tokens"],
                   "projects": sum(a["name"] != "python-stdlib" for a in manifest["archives"]), "stdlib": manifest["stdlib"],
                   "heldout": manifest["heldout"]["packages"], "dedup": manifest["dedup"],
                   "tokenizer": manifest["tokenizer"], "licenses": manifest["licenses"]},
        "target": {"config": target_run["config"], "history": target_run["history"]},
        "regen": {"total_generated_tokens": regen["total_generated_tokens"],
                  "greedy_repeated_line_share_96": regen["greedy_repeated_line_share_96"],
                  "generated_tokens_per_s": regen["generated_tokens_per_s"]},
        "drafters": drafters,
    }


def target_card(rec: dict[str, Any], params: int, size: int, fp8: bool = False) -> str:
    cfg, last = rec["target"]["config"], rec["target"]["history"][-1]
    shape, c = cfg["shape"], rec["corpus"]
    tokens = sum(h["tokens"] for h in rec["target"]["history"])
    seconds = sum(h["seconds"] for h in rec["target"]["history"])
    perplexity = "; ".join(f"{label} {last[key]:.2f}" for key, label in (
        ("heldout_perplexity", "held-out stdlib packages"), ("valid_perplexity", "validation projects"))
        if last.get(key) is not None) or "not measured"
    licenses = "; ".join(f"{name}: {', '.join(projects)}" for name, projects in sorted(c["licenses"].items()))
    weights = ("FP8: the decoder layers' products in e4m3 with scales over 128 x 128 blocks, as `blockspec quantize` "
               "writes them from the trained bf16 model, embeddings and norms bf16; on a CPU blockspec computes "
               "with them dequantized to fp32" if fp8 else "bf16; blockspec loads it as fp32 on a CPU")
    ours = "`LLM(\"default\")`, or `LLM` given this directory"
    loads = (f"blockspec ({ours}), vLLM and SGLang, and `transformers` where it reads FP8 checkpoints"
             if fp8 else f"`blockspec` ({ours}) and with `transformers.AutoModelForCausalLM`")
    return f"""# blockspec flagship target (Qwen3 architecture, Python code)

A small causal LM pretrained from scratch by `python -m blockspec.train.recipes.flagship` so that
blockspec can show block speculation on a real pair without downloads. It continues Python code;
it is not an assistant.

- **Architecture**: Qwen3 (q/k-norm, SwiGLU, GQA, RoPE theta {shape['rope_theta']:g}), hidden {shape['hidden_size']},
  {shape['num_layers']} layers, {shape['num_heads']} heads / {shape['num_kv_heads']} KV heads of dim {shape['head_dim']},
  MLP {shape['intermediate_size']}, vocab {shape['vocab_size']}, tied embeddings, max positions
  {shape['max_position_embeddings']}.
- **Parameters**: {params:,} ({size / 1e6:.1f} MB on disk, {weights}).
- **Data**: {c['train_tokens']:,} tokens ({c['train_files']:,} files) of Python source: {c['projects']} pinned
  source distributions from the package index (`blockspec/train/recipes/python_sources.json`; name,
  version and sha256 of every archive in `corpus_manifest.json` beside this card) and the CPython
  {c['stdlib']['python']} standard library, files deduplicated ({c['dedup']['duplicates_dropped']} dropped). The stdlib
  packages {', '.join(c['heldout'])} are held out of everything (target, tokenizer, drafters) and used
  only for evaluation.
- **Licenses**: the corpus projects' own licenses (as declared in their metadata): {licenses}.
- **Tokenizer**: byte-level BPE trained on a sample of the training files, vocab {c['tokenizer']['vocab_size']};
  special tokens {', '.join(f'`{t}`' for t in c['tokenizer']['special_tokens'])} (`<|endoftext|>` is EOS,
  `<|mask|>` the drafters' mask token).
- **Training**: {last['to_step']} steps of {cfg['batch_size']} x {cfg['seq_len']} tokens ({last['epoch']:g} epochs, {tokens:,}
  tokens) in {seconds / 60:.1f} minutes on one H200 ({last['tokens_per_s']:,} tokens/s), AdamW lr {cfg['lr']:g},
  warm-up + cosine to {cfg['min_lr_ratio']:g}x, weight decay {cfg['weight_decay']:g}, clip {cfg['grad_clip']:g}.
- **Perplexity**: {perplexity}.
- **Greedy repetition**: {rec['regen']['greedy_repeated_line_share_96']:.1%} of the lines of its 96-token greedy
  continuations (of openings of the training corpus) repeat an earlier line of the same continuation.

Loads with {loads}.
"""


def drafter_record(state_dir: Path) -> dict[str, Any]:
    """A drafter run's configuration, best evaluation, steps and training time, from its state index."""
    run = read_index(state_dir)["state"]["run"]
    best = next(e for e in run["evals"] if e["step"] == run["best"]["step"])
    return {"config": run["config"], "best": best, "total_steps": run["total"],
            "train_seconds": sum(h.get("train_seconds", 0.0) for h in run["history"])}


def drafter_card(rec: dict[str, Any], method: str, shape: DrafterConfig, params: int, size: int) -> str:
    d = rec["drafters"][method]
    t = dataclasses.asdict(DrafterStageConfig(**d["config"]).train_config("cpu"))  # the trainer's defaults filled in
    more = d.get("continued")
    best = more["best"] if more else d["best"]
    continued = "" if not more else f"""
- **Continued** from those weights (fresh AdamW and cosine schedule, lr {more['config']['train']['lr']:g}) on
  {more['rows_tokens']:,} more generated tokens, continuations of openings the first run never used:
  {more['total_steps']} steps ({more['config']['epochs']:g} epochs, {more['train_seconds'] / 60:.1f} minutes on one H200)."""
    fmt = ("z-lab DFlash (`DFlashDraftModel`, no embedding or head: it shares the target's); loads with blockspec "
           "(`speculative_config={\"method\": \"dflash\", \"model\": ...}`) and with the reference code"
           if method == "dflash" else
           "DeepSpec DSpark (`Qwen3DSparkModel`) without the copies of the target's embedding and head that DeepSpec "
           "files carry (2 x vocab x hidden values): blockspec takes the target's, as vLLM does "
           "(`speculative_config={\"method\": \"dspark\", \"model\": ...}`); "
           "`blockspec.drafters.restore_target_copies(\"dspark\", \"target\", OUT)` writes the file the reference "
           "code loads")
    heads = (f"Markov head ({t['markov_head_type']}, rank {t['markov_rank']}) and confidence head; "
             if method == "dspark" else "")
    per_pos = " ".join(f"{p:.2f}" for p in best["per_position"])
    return f"""# blockspec flagship {'DFlash' if method == 'dflash' else 'DSpark'} drafter

The drafter of the flagship target (`../target`), trained by `python -m blockspec.train.recipes.flagship`.

- **Format**: {fmt}.
- **Shape**: {shape.num_layers} layers, MLP {shape.intermediate_size}, block {shape.block_size}; {heads}target
  features from layers {', '.join(map(str, shape.target_layer_ids))}. {params:,} parameters ({size / 1e6:.1f} MB, bf16).
- **Data**: the target's own continuations (greedy and T = 0.7, 448 tokens each) of 64-token openings
  of the training corpus: {rec['regen']['total_generated_tokens']:,} generated tokens.
- **Training**: the reference objective (random anchors, position-decayed loss), {d['total_steps']} steps of
  {t['batch_size']} rows of {t['max_len']} tokens ({d['config']['epochs']:g} epochs, {d['train_seconds'] / 60:.1f} minutes on one H200),
  {t['num_anchors']} anchors a row, AdamW lr {t['lr']:g}; the weights of the evaluation with the best acceptance
  are kept.{continued}
- **Acceptance** (greedy, whole block verified, held-out openings outside the demo's prompts, through
  the engine): {best['acceptance']:.2f} tokens per verify step; P(first k drafts accepted): {per_pos}.
  `acceptance.json` records this for the engine's draft-length policy.
"""


def assemble(run_dir: Path, out: Path, states: dict[str, str] | None = None, fp8_target: bool = False
             ) -> dict[str, Any]:
    """Copy the run's exports (run_dir/{target,dflash,dspark}) to `out` with their cards and metrics.json;
    `states`: the drafter state directories the exports came from, where not <method>-state. `fp8_target`: ship
    the target as its FP8 twin (`blockspec quantize`: the decoder products in e4m3, about half their bytes), which
    the drafters, trained on the bf16 target's taps, draft for as well."""
    for name in PAIR:
        if not (run_dir / name / "config.json").is_file():
            raise FileNotFoundError(f"{run_dir / name}: no export (run local.sh export-target / export-drafters)")
    rec = run_record(run_dir, states)
    if out.exists():
        shutil.rmtree(out)
    if fp8_target:
        write_fp8_checkpoint(run_dir / "target", out / "target")
    else:
        shutil.copytree(run_dir / "target", out / "target")
    params, size = _params(out / "target"), (out / "target" / "model.safetensors").stat().st_size
    (out / "target" / "README.md").write_text(target_card(rec, params, size, fp8_target))
    shutil.copy2(run_dir / "corpus" / "manifest.json", out / "target" / "corpus_manifest.json")
    rec["assets"] = {"target": {"parameters": params, "bytes": size}}
    for method in PAIR[1:]:
        shutil.copytree(run_dir / method, out / method)
        ship_drafter(out, method, rec)
    return rec["assets"]


def continue_drafter(pair: Path, method: str, state_dir: Path, rows_tokens: int) -> dict[str, Any]:
    """Replace the shipped pair's `method` drafter by the best of a run that continued it (``--init``) on
    `rows_tokens` more generated tokens: the export, its recorded acceptance, metrics.json (the first run's
    record stays, the continuation beside it) and the card."""
    record = drafter_record(state_dir)
    if record["config"].get("init") is None:
        raise ValueError(f"{state_dir}: not a continued run (its configuration has no init)")
    export_best(state_dir, pair / "target", pair / method)
    rec = json.loads((pair / "metrics.json").read_text())
    rec["drafters"][method]["continued"] = record | {"rows_tokens": rows_tokens}
    ship_drafter(pair, method, rec)
    return rec["drafters"][method]["continued"]["best"]


def ship_drafter(pair: Path, method: str, rec: dict[str, Any]) -> None:
    """Make the export in pair/`method` the shipped drafter: a DSpark without its copies of the target's
    embedding and head (`strip_target_copies`), its card, and its sizes in `rec`, written to metrics.json."""
    if method == "dspark":
        strip_target_copies(pair / method, pair / "target")
    params, size = _params(pair / method), (pair / method / "model.safetensors").stat().st_size
    rec["assets"][method] = {"parameters": params, "bytes": size}
    rec["assets"]["total_bytes"] = _pair_bytes(pair)
    (pair / method / "README.md").write_text(
        drafter_card(rec, method, load_drafter(method, pair / method, device="cpu").config, params, size))
    (pair / "metrics.json").write_text(json.dumps(rec, indent=1) + "\n")
