"""Per-step trace of the embedded pair at 16 in flight (64 requests x 256 tokens, ignore_eos): for each engine step,
its wall time, the requests it prefilled and decoded, and the speculative launches (K, rows, chained or not).
Answers where a speculative pass's time goes beyond its drafting steps: prefill steps, half-empty batches."""
import gc, json, os, sys, time
from collections import defaultdict
from pathlib import Path
import torch
from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
methods = sys.argv[2].split(",") if len(sys.argv) > 2 else ["plain", "dspark"]
temps = [float(t) for t in (sys.argv[3].split(",") if len(sys.argv) > 3 else ["0"])]
base, _ = default_pair()
N, M, DEV = int(os.environ.get("N", 64)), int(os.environ.get("M", 256)), os.environ.get("DEV", "cuda")
prompts = heldout_prompts(N)
report = []
for method in methods:
    spec = None if method == "plain" else {"method": method, "model": str(base / method),
                                           "adaptive_draft_length": os.environ.get("FIXED") is None}
    llm = LLM(str(base / "target"), device=DEV, dtype="float32", seed=0, max_num_seqs=16, speculative_config=spec)
    eng = llm.engine
    for temp in temps:
        params = SamplingParams(temperature=temp, max_tokens=M, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
        steps, cur = [], {}
        o_step, o_pre, o_dec, o_ls = eng._step, eng._prefill, eng._decode, eng._launch_spec
        def t_pre(reqs):
            cur["prefill"] = cur.get("prefill", 0) + len(reqs); return o_pre(reqs)
        def t_dec(reqs):
            cur["decode"] = len(reqs); return o_dec(reqs)
        def t_ls(reqs, k, ahead=None, anchors=None, after=None):
            cur.setdefault("launch", []).append((len(reqs), k, after is not None)); return o_ls(reqs, k, ahead, anchors, after)
        def t_step():
            cur.clear(); t0 = time.perf_counter(); r = o_step(); cur["ms"] = 1e3 * (time.perf_counter() - t0)
            steps.append(dict(cur)); return r
        eng._step, eng._prefill, eng._decode, eng._launch_spec = t_step, t_pre, t_dec, t_ls
        gc.collect(); gc.freeze()
        DEV == "cuda" and torch.cuda.synchronize(); t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        DEV == "cuda" and torch.cuda.synchronize(); wall = time.perf_counter() - t0
        gc.unfreeze()
        eng._step, eng._prefill, eng._decode, eng._launch_spec = o_step, o_pre, o_dec, o_ls
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        by = defaultdict(lambda: [0, 0.0])
        for s in steps:
            kind = ("prefill+" if s.get("prefill") else "") + f"decode{s.get('decode', 0)}" + "".join(
                f" launch{n}K{k}{'c' if c else ''}" for n, k, c in s.get("launch", []))
            by[kind][0] += 1; by[kind][1] += s["ms"]
        pre_ms = sum(s["ms"] for s in steps if s.get("prefill"))
        dec_rows = sum(s.get("decode", 0) for s in steps if not s.get("prefill"))
        dec_steps = sum(1 for s in steps if not s.get("prefill") and s.get("decode"))
        line = (f"{method} T={temp}: {toks} tokens in {wall * 1e3:.1f} ms = {toks / wall:,.0f} tok/s; {len(steps)} steps, "
                f"{sum(1 for s in steps if s.get('prefill'))} with a prefill ({pre_ms:.1f} ms); "
                f"decode-only steps {dec_steps}, mean {dec_rows / max(dec_steps, 1):.2f} requests, "
                f"{sum(s['ms'] for s in steps if not s.get('prefill')):.1f} ms; stats {llm.get_stats().get('policy_steps')}")
        print(line, flush=True)
        report.append(line)
        for kind, (n, ms) in sorted(by.items(), key=lambda kv: -kv[1][1])[:25]:
            report.append(f"    {kind}: {n} steps, {ms:.1f} ms, {ms / n:.3f} ms each")
        (out / f"steps_{method}_T{temp}.json").write_text(json.dumps(steps))
    del llm, eng; gc.collect(); DEV == "cuda" and torch.cuda.empty_cache()
(out / "step_trace.txt").write_text("\n".join(report) + "\n")
print("\n".join(report))
