"""Paired A/B inside one engine: prompt by prompt, order alternated. Usage: ab.py ROUNDS MODULE (MODULE defines arms(llm) -> {name: setter})."""
import time, statistics, json, sys, importlib.util
from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", dtype="float32", speculative_config={"method": "dspark", "model": str(base / "dspark")}, seed=0, max_num_seqs=1)
spec = importlib.util.spec_from_file_location("arms", sys.argv[2]); mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
arms = mod.arms(llm)
names = list(arms)
prompts = continued_prompts(llm, heldout_prompts(16), 8)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
import os
sp = SamplingParams(temperature=0, max_tokens=128, seed=0 if os.environ.get("SEED") else None, use_speculation=not os.environ.get("PLAIN"))
times = {a: [] for a in names}; outs = {a: [] for a in names}
for rnd in range(int(sys.argv[1])):
    for i, p in enumerate(prompts):
        order = names if (i + rnd) % 2 == 0 else names[::-1]
        for arm in order:
            arms[arm]()
            t = time.perf_counter(); o = llm.generate([p], sp, use_tqdm=False); times[arm].append(time.perf_counter() - t)
            outs[arm].append(tuple(o[0].outputs[0].token_ids))
a, b = names
ratios = [y / x for x, y in zip(times[a], times[b])]
q = statistics.quantiles(ratios, n=4)
print(json.dumps({f"{b}_over_{a}_time": {"median": round(q[1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4)}, "units": len(ratios),
       "total_s": {k: round(sum(v), 3) for k, v in times.items()}, "outputs_identical": outs[a] == outs[b]}))
