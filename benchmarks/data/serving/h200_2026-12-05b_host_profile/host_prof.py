"""Host profile of the embedded pair at 16 in flight: wall per step, torch ops and launches per step."""
import json, sys, time, collections
import torch
from torch.profiler import profile, ProfilerActivity
from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams

out, method, temp = sys.argv[1], sys.argv[2], float(sys.argv[3])
mode = sys.argv[4] if len(sys.argv) > 4 else "prof"
dev = "cuda" if torch.cuda.is_available() else "cpu"
base, _ = default_pair()
spec = None if method == "plain" else {"method": method, "model": str(base / method)}
llm = LLM(str(base / "target"), device=dev, dtype="float32", speculative_config=spec, seed=0, max_num_seqs=16)
prompts = heldout_prompts(64)
params = [SamplingParams(temperature=temp, seed=i, max_tokens=64, ignore_eos=True) for i in range(len(prompts))]
llm.generate(prompts, params, use_tqdm=False)
def run():
    m0 = llm.engine.metrics()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    m1 = llm.engine.metrics()
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = m1["num_steps"] - m0["num_steps"]
    pol = {k: m1.get("policy_steps", {}).get(k, 0) - m0.get("policy_steps", {}).get(k, 0) for k in m1.get("policy_steps", {})}
    split = {k: round(m1[k] - m0.get(k, 0), 4) for k in m1 if k.endswith("_s")}
    return dict(wall=wall, toks=toks, steps=steps, tok_s=toks / wall, ms_per_step=wall / steps * 1e3, policy=pol, split=split)
res = [run() for _ in range(3)]
for r in res: print(method, temp, json.dumps(r))
if mode == "prof":
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = run()
    ev = prof.key_averages()
    with open(f"{out}/ops_{method}_{temp}.txt", "w") as f:
        f.write(json.dumps(r) + "\n")
        f.write(ev.table(sort_by="self_cpu_time_total", row_limit=60))
    cnt = {e.key: e.count for e in ev}
    keys = [k for k in cnt if k.startswith("cuda") or k.startswith("aten::")]
    n = r["steps"]
    top = sorted(((cnt[k] / n, k) for k in keys), reverse=True)[:40]
    print(method, temp, "per step:", ", ".join(f"{k} {c:.1f}" for c, k in top))
json.dump(res, open(f"{out}/wall_{method}_{temp}.json", "w"))
