"""How far FP8 weights or an FP8 KV cache move a model: logit KL and greedy agreement against the
model dtype, on held-out prompts.

The reference (the checkpoint in its dtype) decodes `new_tokens` greedy tokens after each prompt;
both models then score that same text in one prefill through their own KV cache (teacher forcing,
so an FP8 cache's rounding counts), which gives at each of those positions KL(p_ref || p_candidate)
and whether the two pick the same top token. The candidate also decodes on its own: the report
gives how many tokens it follows the reference for before the two part, and how many prompts it
matches for all `new_tokens`.

    python -m blockspec.bench.accuracy --model default --out fp8_accuracy.json
    python -m blockspec.bench.accuracy --model FP8_DIR --quantization none --kv-cache-dtype fp8 \
        [--candidate-model FP8_DIR_WITH_KV_SCALES]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from blockspec.assets import embedded
from blockspec.llm import LLM
from blockspec.models.kv_cache import causal_meta
from blockspec.sampling_params import SamplingParams


def heldout_text_prompts(count: int) -> list[str]:
    """Openings of functions from the standard-library packages the embedded model never trained on."""
    from blockspec.demo import heldout_prompts

    return heldout_prompts(count)


def scores(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's next-token log-probabilities [len - 1, V] (fp32), in one prefill through a cache of
    the engine's KV dtype and scales (attention reads the keys and values as that cache stores them)."""
    model = llm.engine.model
    device = model.embed_tokens.weight.device
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq], device=device)
            cache = model.new_cache(1, len(seq))
            hidden, _ = model(ids, causal_meta([0], [0], [len(seq)], len(seq), cache.trash, device,
                                               model.config.sliding_window, model.config.layer_types), cache)
            out.append(torch.log_softmax(model.compute_logits(hidden[0, :-1]).double(), dim=-1).cpu())
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fp8_accuracy(model: str | Path = "default", num_prompts: int = 16, new_tokens: int = 256,
                 dtype: str = "auto", device: str = "cpu", quantization: str | None = "fp8",
                 candidate_dtype: str | None = None, kv_cache_dtype: str = "auto",
                 candidate_model: str | Path | None = None) -> dict[str, Any]:
    """The report (see the module's docstring) for `model` ('default': the embedded target) in `dtype` against
    `candidate_model` (default: the same) with `quantization` and `kv_cache_dtype` (in `candidate_dtype`,
    default `dtype`: with quantization None and an "auto" cache, a dtype's own drift for scale)."""
    common = dict(device=device, max_model_len=1024, max_num_seqs=num_prompts, warmup=False)
    model = embedded(str(model))
    ref = LLM(model, dtype=dtype, **common)
    quant = LLM(embedded(str(candidate_model or model)), dtype=candidate_dtype or dtype, quantization=quantization,
                kv_cache_dtype=kv_cache_dtype, **common)
    text = heldout_text_prompts(num_prompts)
    greedy = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ref_out = ref.generate(text, greedy, use_tqdm=False)
    quant_out = quant.generate(text, greedy, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in ref_out]
    kl, agree, per_prompt = [], [], []
    for o, p, q in zip(ref_out, scores(ref, sequences), scores(quant, sequences)):
        start = len(o.prompt_token_ids) - 1  # the rows that predict the generated tokens
        p, q = p[start:], q[start:]
        k = (p.exp() * (p - q)).sum(-1)
        same = p.argmax(-1) == q.argmax(-1)
        kl.extend(k.tolist())
        agree.extend(same.tolist())
        per_prompt.append({"prompt_tokens": len(o.prompt_token_ids), "mean_kl": float(k.mean()),
                           "top1_agreement": float(same.float().mean())})
    prefixes = [common_prefix(r.outputs[0].token_ids, f.outputs[0].token_ids) for r, f in zip(ref_out, quant_out)]
    for row, n in zip(per_prompt, prefixes):
        row["free_running_common_prefix"] = n
    weight = ref.engine.model.embed_tokens.weight
    candidate = str(quant.engine.model.embed_tokens.weight.dtype).replace("torch.", "")
    scales = quant.engine.model.kv_scales.values() if quant.engine.model.kv_scales is not None else [1.0]
    low, high = min(scales), max(scales)
    kv = (f", {kv_cache_dtype} KV cache at scale{f's {low:.3g}-{high:.3g}' if low < high else f' {low:.3g}'}"
          if kv_cache_dtype != "auto" else "")
    return {
        "model": str(model), "candidate_model": str(candidate_model or model),
        "reference_dtype": str(weight.dtype).replace("torch.", ""),
        "candidate": (f"{quantization} weights, {candidate}" if quantization else candidate) + kv,
        "quantization": quantization, "kv_cache_dtype": kv_cache_dtype,
        "device": str(weight.device), "prompts": len(text), "new_tokens": new_tokens,
        "teacher_forced": {"mean_kl": statistics.fmean(kl), "median_kl": statistics.median(kl), "max_kl": max(kl),
                           "top1_agreement": statistics.fmean(agree), "positions": len(kl)},
        "free_running": {"mean_common_prefix": statistics.fmean(prefixes), "min_common_prefix": min(prefixes),
                         "identical_prompts": sum(n == new_tokens for n in prefixes),
                         "token_agreement_before_first_difference": sum(prefixes) / (new_tokens * len(prefixes))},
        "per_prompt": per_prompt,
    }


def summary(r: dict[str, Any]) -> str:
    t, f = r["teacher_forced"], r["free_running"]
    return (f"{r['candidate']} vs {r['reference_dtype']} ({r['prompts']} held-out prompts x {r['new_tokens']} "
            f"tokens): mean KL {t['mean_kl']:.2e} nats (median {t['median_kl']:.2e}, max {t['max_kl']:.2e}), top-1 "
            f"agreement {t['top1_agreement']:.2%}; free-running greedy: {f['identical_prompts']}/{r['prompts']} prompts "
            f"identical for all {r['new_tokens']} tokens, mean common prefix {f['mean_common_prefix']:.0f} tokens "
            f"(min {f['min_common_prefix']})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="HF directory or hub id, or 'default' (the embedded model)")
    p.add_argument("--dtype", default="auto", help="the reference dtype (auto: fp32 on CPU, the checkpoint's on GPU)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quantization", default="fp8", help="the candidate's quantization ('none': only --candidate-dtype)")
    p.add_argument("--candidate-dtype", default=None, help="the candidate's dtype (default: --dtype)")
    p.add_argument("--candidate-model", default=None, help="the candidate's checkpoint (default: --model)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the candidate's KV cache ('fp8': e4m3 at the "
                                                            "checkpoint's scales, else 1.0)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--out", default=None, help="write the report as JSON here")
    args = p.parse_args(argv)
    quantization = None if args.quantization == "none" else args.quantization
    result = fp8_accuracy(args.model, args.num_prompts, args.new_tokens, args.dtype, args.device, quantization,
                          args.candidate_dtype, args.kv_cache_dtype, args.candidate_model)
    print(summary(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
