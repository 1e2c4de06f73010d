"""Per-kernel device time of the default pair's steps, and device time per graph replay (CUDA events)."""
import os, sys, torch
from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams
from blockspec.demo import default_pair, heldout_prompts
from torch.profiler import profile, ProfilerActivity
OUT = os.environ["OUT"]
base, _ = default_pair()
prompts = heldout_prompts(3)
def device_ms(graph, n=200):
    for _ in range(10): graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): graph.replay()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n
for dtype in os.environ.get("DTYPES", "float32,bfloat16").split(","):
  for method in ("dspark", "dflash"):
    llm = LLM(str(base / "target"), device="cuda", dtype=dtype, speculative_config={"method": method, "model": str(base / method), "adaptive_draft_length": False}, seed=0, max_num_seqs=1)
    sp = SamplingParams(temperature=0, max_tokens=128)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    eng = llm.engine
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[2:3], sp, use_tqdm=False); torch.cuda.synchronize()
    print(dtype, method, "steps chained", eng.num_spec_steps_chained)
    with open(f"{OUT}/kernels_{dtype}_{method}.txt", "w") as f:
        f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
    for key, cap in list(eng.runner.graphs.items())[:2]:
        print(dtype, method, "runner graph", key, f"device {device_ms(cap.graph):.3f} ms")
    for key, cap in list(eng.proposer.graphs.graphs.items())[:2]:
        print(dtype, method, "draft graph", key, f"device {device_ms(cap.graph):.3f} ms")
    for key, cap in list(eng.proposer.steps.graphs.items()):
        print(dtype, method, "step graph", key, f"device {device_ms(cap.graph):.3f} ms")
    sys.stdout.flush()
    del llm, eng; torch.cuda.empty_cache()
