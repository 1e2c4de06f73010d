import time, statistics, json, sys
from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", dtype="float32", speculative_config={"method": "dspark", "model": str(base / "dspark")}, seed=0, max_num_seqs=1)
model = llm.engine.model
screen = model.head_screen
assert screen is not None
prompts = continued_prompts(llm, heldout_prompts(16), 8)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
sp = SamplingParams(temperature=0, max_tokens=128)
arms = {"float32 head": None, "screened": screen}
times = {a: [] for a in arms}; outs = {a: [] for a in arms}
for rnd in range(int(sys.argv[1])):
    for i, p in enumerate(prompts):
        order = list(arms) if (i + rnd) % 2 == 0 else list(arms)[::-1]
        for arm in order:
            model.head_screen = arms[arm]
            t = time.perf_counter(); o = llm.generate([p], sp, use_tqdm=False); times[arm].append(time.perf_counter() - t)
            outs[arm].append(tuple(o[0].outputs[0].token_ids))
ratios = [b / a for a, b in zip(times["float32 head"], times["screened"])]
q = statistics.quantiles(ratios, n=4)
res = {"screened_over_float32_time": {"median": q[1], "q1": q[0], "q3": q[2]}, "units": len(ratios),
       "total_s": {a: sum(v) for a, v in times.items()}, "outputs_identical": outs["float32 head"] == outs["screened"]}
print(json.dumps(res))
