import time, sys
from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", dtype="float32", speculative_config={"method": "dspark", "model": str(base / "dspark")}, seed=0, max_num_seqs=1)
prompts = continued_prompts(llm, heldout_prompts(16), 8)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
spec = SamplingParams(temperature=0, max_tokens=128, seed=0)
plain = SamplingParams(temperature=0, max_tokens=128, seed=0, use_speculation=False)
ts = {"spec": 0.0, "plain": 0.0}
for rnd in range(2):
    for i, p in enumerate(prompts):
        for mode in (("plain", "spec") if (i + rnd) % 2 == 0 else ("spec", "plain")):
            t = time.perf_counter(); llm.generate([p], spec if mode == "spec" else plain, use_tqdm=False); ts[mode] += time.perf_counter() - t
print(f"spec {ts['spec']:.3f} plain {ts['plain']:.3f} ratio {ts['plain']/ts['spec']:.3f}")
