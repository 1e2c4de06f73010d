import time, sys
from blockspec import LLM, SamplingParams
from blockspec.demo import default_pair
base, _ = default_pair()
q = sys.argv[1] if len(sys.argv) > 1 else None
llm = LLM(str(base / "target"), device="cpu", dtype="float32", quantization=q if q != "none" else None)
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
prompt = [{"prompt_token_ids": list(range(5, 40))}]
llm.generate(prompt, p, use_tqdm=False)
best = 1e9
for _ in range(3):
    t = time.perf_counter(); out = llm.generate(prompt, p, use_tqdm=False); best = min(best, time.perf_counter() - t)
print(q, f"{64 / best:.1f} tok/s", out[0].outputs[0].token_ids[:8])
