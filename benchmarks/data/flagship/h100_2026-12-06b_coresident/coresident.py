"""The embedded pair's plain engine, one process: its decode step alone, beside built DFlash and DSpark engines,
after their passes, with the collector frozen, and with them deleted (bench preset, batch 16, one static wave)."""
import gc, statistics, sys, torch
from blockspec.bench.harness import BenchConfig, prepare, build_engine, drive, point_pages, context_len, SharedKVStore
from blockspec.sampling_params import SamplingParams
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = BenchConfig(preset="default", device=dev, methods=("plain", "dflash", "dspark"), batch_sizes=(16,),
                  temperatures=(0.0,), repeats=3)
cfg.apply_preset()
cfg.validate()
setup = prepare(cfg, torch.device(dev))
prompts = setup.prompts[next(iter(setup.prompts))][:16]
params = [SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True, seed=i) for i in range(16)]
max_len = context_len(prompts, cfg.output_len)
drafters = {m: setup.make_drafter(m) for m in ("dflash", "dspark")}
pages = point_pages(cfg, setup, [("plain", None), ("dflash", None), ("dspark", None)], drafters, 16, max_len)
store = SharedKVStore()
with store.engine():
    plain = build_engine(cfg, setup, "plain", None, 16, max_len=max_len, num_kv_pages=pages)


def step_ms(n=5):
    out = []
    for _ in range(n):
        p = drive(plain, prompts, params)
        out.append(1e3 * p.decode_s / max(1, sum(len(v) for v in p.step_s.values())))
    return f"{statistics.median(out):.4f} ms (runs {', '.join(f'{x:.4f}' for x in out)})"


drive(plain, prompts, params)
print("alone", step_ms(), flush=True)
spec = {}
for m in ("dflash", "dspark"):
    with store.engine():
        spec[m] = build_engine(cfg, setup, m, drafters[m], 16, max_len=max_len, num_kv_pages=pages)
print("beside, built", step_ms(), flush=True)
for e in spec.values():
    drive(e, prompts, params)
print("beside, after their passes", step_ms(), flush=True)
gc.collect()
gc.freeze()
print("beside, collector frozen", step_ms(), flush=True)
gc.unfreeze()
gc.disable()
print("beside, collector off", step_ms(), flush=True)
gc.enable()
del spec
gc.collect()
print("speculative engines deleted", step_ms(), flush=True)
