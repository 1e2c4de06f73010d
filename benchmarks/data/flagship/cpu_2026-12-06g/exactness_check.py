import sys, collections
import torch
from blockspec.demo import default_pair, heldout_prompts
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from draft_temperature import scaled  # the draft rows' temperatures scaled (run from this folder)
base, _ = default_pair()
prompt = heldout_prompts(8)[int(sys.argv[1]) if len(sys.argv) > 1 else 0]
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
T = 0.7
def counts(llm):
    params = [SamplingParams(temperature=T, seed=i, max_tokens=4, ignore_eos=True) for i in range(N)]
    outs = llm.generate([prompt] * N, params, use_tqdm=False)
    return [tuple(o.outputs[0].token_ids) for o in outs]
plain = LLM(str(base / "target"), device="cpu", seed=0, max_num_seqs=256)
ref = counts(plain)
spec = {"method": "dflash", "model": str(base / "dflash"), "adaptive_draft_length": False,
        "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
llm = LLM(str(base / "target"), device="cpu", speculative_config=spec, seed=0, max_num_seqs=256)
orig = llm.engine.proposer.propose
def chi2(a, b, pos):
    ca = collections.Counter(t[pos] for t in a); cb = collections.Counter(t[pos] for t in b)
    keys = set(ca) | set(cb)
    stat, df, small_a, small_b = 0.0, -1, 0, 0
    for k in keys:
        x, y = ca[k], cb[k]
        if x + y < 10: small_a += x; small_b += y; continue
        stat += (x - y) ** 2 / (x + y); df += 1
    if small_a + small_b: stat += (small_a - small_b) ** 2 / (small_a + small_b); df += 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)).item()
    return round(stat, 1), df, p
for f in (1.0, 0.3):
    llm.engine.proposer.propose = orig if f == 1 else scaled(orig, f)
    out = counts(llm)
    same = sum(a == b for a, b in zip(out, ref))
    print("factor", f, "identical samples", same, "of", N, [("pos", pos, chi2(out, ref, pos)) for pos in (1, 2, 3)], flush=True)
