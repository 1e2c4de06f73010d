import json, math, torch
from blockspec.demo import continued_prompts, default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
base, _ = default_pair()
llm = LLM(str(base / "target"), device="cpu", dtype="float32", speculative_config={"method": "dspark", "model": str(base / "dspark"), "adaptive_draft_length": False, "confidence_threshold": 1e-9}, seed=0, max_num_seqs=1)
prop = llm.engine.proposer
demo = set(continued_prompts(llm, heldout_prompts(16), 8))
prompts = [p for p in continued_prompts(llm, heldout_prompts(96), 64) if p not in demo][:48]
rows, outs = [], []
orig = prop._confident_lengths
def conf(c, lens):
    rows.append(c[0].tolist()); return orig(c, lens)
prop._confident_lengths = conf
o2 = prop.record_outcome
def rec(lens, acc):
    outs.append(acc[0]); return o2(lens, acc)
prop.record_outcome = rec
for p in prompts:
    llm.generate([p], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
print(len(rows), len(outs))
json.dump({"conf": rows, "acc": outs}, open("confidence_samples.json", "w"))
