"""Paired A/B of the embedded pair's decoding on the CPU, inside one engine: arms swapped between runs, unit by unit.

On this project's 2-core host a process's own speed offset (memory layout, the host's load) is about 3 %, more than
most single changes to the step, so runs of two commits in two processes cannot tell them apart. Here every arm runs
every unit (one of the demo's held-out prompts at batch 1, all of them at once above) in each mode back to back, the
order reversed unit by unit, so a drift of the machine's speed falls on all; an arm's cost is its time over the first
arm's on the same unit and mode (median and quartiles over units). Outputs must agree between arms.

    python benchmarks/cpu_ab.py ARMS.py [--rounds 4] [--modes spec] [--method dspark] [--seed 0] [--out ab.json]

ARMS.py defines `arms(llm) -> dict[str, Callable[[], ContextManager]]`: entering an arm's context puts it in place
(a method swapped on the engine's objects, a product routed elsewhere: `swapped`), leaving it restores the engine;
the engine as it is: `contextlib.nullcontext`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ContextManager

Arms = dict[str, Callable[[], ContextManager]]
_ABSENT = object()  # an attribute the instance did not hold before `swapped` set it


@contextlib.contextmanager
def swapped(pairs: list[tuple[object, str, Any]]) -> Iterator[None]:
    """Each (object, attribute, value) set for the context, the attributes as they were afterwards (an attribute
    an instance did not hold is deleted again, so its class's shows through)."""
    saved = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in pairs]
    for obj, name, value in pairs:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old in reversed(saved):
            if old is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def quartiles(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return [round(v, 4) for v in q]


def embedded_llm(method: str = "dspark", batch: int = 1) -> Any:
    """The embedded pair on the CPU in float32, as `blockspec demo` runs it."""
    from blockspec.demo import default_pair
    from blockspec.llm import LLM

    base, _ = default_pair()
    return LLM(str(base / "target"), device="cpu", dtype="float32", seed=0, max_num_seqs=batch,
               speculative_config={"method": method, "model": str(base / method)})


def paired(llm: Any, arms: Arms, rounds: int, modes: tuple[str, ...] = ("spec",), batch: int = 1,
           max_tokens: int = 128, seed: int | None = 0, temperature: float = 0.0) -> dict:
    """Seconds of every (arm, mode) on every unit, each arm's time over the first arm's per unit, speculative over
    plain per arm (with both modes), and whether the arms' outputs agree."""
    from blockspec.demo import continued_prompts, heldout_prompts
    from blockspec.sampling_params import SamplingParams

    prompts = continued_prompts(llm, heldout_prompts(16), 8)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    units = [[p] for p in prompts] if batch == 1 else [prompts]
    runs = [(arm, mode) for arm in arms for mode in modes]
    seconds: dict[str, list[float]] = {f"{arm}, {mode}": [] for arm, mode in runs}
    outputs: dict[str, set] = {}
    for r in range(rounds):
        for u, unit in enumerate(units):
            for arm, mode in runs if (r + u) % 2 == 0 else runs[::-1]:
                params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                        use_speculation=mode == "spec")
                with arms[arm]():
                    start = time.perf_counter()
                    done = llm.generate(unit, params, use_tqdm=False)
                    seconds[f"{arm}, {mode}"].append(time.perf_counter() - start)
                outputs.setdefault(mode, set()).add((u, tuple(tuple(o.outputs[0].token_ids) for o in done)))
    first = next(iter(arms))
    result = {"batch": batch, "temperature": temperature, "rounds": rounds, "units": len(units), "seconds": seconds,
              "total_s": {k: round(sum(v), 3) for k, v in seconds.items()},
              f"over_{first}": {k: quartiles([t / t0 for t, t0 in zip(v, seconds[f"{first}, {k.split(', ')[1]}"])])
                                for k, v in seconds.items()},
              "outputs_agree": all(len(v) == len(units) for v in outputs.values())}
    if {"plain", "spec"} <= set(modes):
        result["spec_over_plain"] = {arm: quartiles([p / s for p, s in zip(seconds[f"{arm}, plain"],
                                                                            seconds[f"{arm}, spec"])]) for arm in arms}
    for key, q in result[f"over_{first}"].items():
        print(f"batch {batch}, {key}: {result['total_s'][key]:.3f} s in all; over {first}'s time on the same unit "
              f"{q[1]:.4f} (quartiles {q[0]:.4f}-{q[2]:.4f})", flush=True)
    for arm, q in result.get("spec_over_plain", {}).items():
        print(f"batch {batch}, {arm}: speculative over plain {q[1]:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})", flush=True)
    print(f"batch {batch}: outputs agree: {result['outputs_agree']}", flush=True)
    return result


def load_arms(path: Path) -> Callable[[Any], Arms]:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arms", type=Path, help="a Python file defining arms(llm)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds over the prompts")
    ap.add_argument("--modes", default="spec", help="spec, plain or both (comma list)")
    ap.add_argument("--method", default="dspark", choices=["dflash", "dspark"])
    ap.add_argument("--batch", type=int, default=1, help="requests at once (above 1: all prompts as one unit)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="the requests' seed (the demo's is 0); -1 for none")
    ap.add_argument("--temperature", type=float, default=0.0, help="the requests' temperature")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    llm = embedded_llm(args.method, args.batch)
    result = paired(llm, load_arms(args.arms)(llm), args.rounds, tuple(args.modes.split(",")), args.batch,
                    args.max_tokens, None if args.seed < 0 else args.seed, args.temperature)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
