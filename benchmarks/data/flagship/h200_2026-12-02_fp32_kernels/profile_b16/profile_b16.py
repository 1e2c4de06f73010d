"""Per-kernel device time of the default pair's batch-16 steps (fp32), and device time per step graph."""
import os, torch
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from blockspec.demo import default_pair, heldout_prompts
from torch.profiler import profile, ProfilerActivity
OUT = os.environ["OUT"]
base, _ = default_pair()
prompts = heldout_prompts(16)
def device_ms(graph, n=100):
    for _ in range(5): graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): graph.replay()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n
for method in ("dspark", "dflash"):
    llm = LLM(str(base / "target"), device="cuda", dtype="float32", speculative_config={"method": method, "model": str(base / method), "adaptive_draft_length": False}, seed=0, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=128)
    llm.generate(prompts[:16], sp, use_tqdm=False)
    eng = llm.engine
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[:16], sp, use_tqdm=False); torch.cuda.synchronize()
    with open(f"{OUT}/kernels_b16_{method}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=100))
    for key, cap in list(eng.runner.graphs.items()):
        if key[0] == 16: print(method, "runner graph", key, f"device {device_ms(cap.graph):.3f} ms")
    for key, cap in list(eng.proposer.graphs.graphs.items()):
        if key[0] == 16: print(method, "draft graph", key, f"device {device_ms(cap.graph):.3f} ms")
    for key, cap in list(eng.proposer.steps.graphs.items()):
        if key[0] == 16: print(method, "step graph", key, f"device {device_ms(cap.graph):.3f} ms")
    del llm, eng; torch.cuda.empty_cache()
