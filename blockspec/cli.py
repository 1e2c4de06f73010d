"""`blockspec` command line: generate, chat, demo, serve, bench, train."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

EXAMPLES = """examples:
  blockspec demo                                   # speculative decoding on the embedded default model
  blockspec generate --model Qwen/Qwen3-8B --prompt "Write a haiku" --max-tokens 64
  blockspec generate --model ./my-model --prompt "def fib(n):" \\
      --draft-model z-lab/Qwen3-8B-DFlash-b16 --num-speculative-tokens 15
  blockspec chat --model ./my-model --prompt "Hello!" --temperature 0.7 --seed 1
"""


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", required=True, help="Hugging Face model directory or hub id of the target model")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length to plan memory for")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    g.add_argument("--tensor-parallel-size", type=int, default=1, help="split the target across N ranks")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "sdpa"],
                   help="auto: the Triton kernel on CUDA when triton is installed, else PyTorch SDPA")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may hold (weights, KV caches, activations)")
    g.add_argument("--kv-page-size", type=int, default=64, help="positions a KV cache page holds")
    g.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pages to allocate (default: what --gpu-memory-utilization leaves on CUDA, enough for "
                        "max-num-seqs x max-model-len on the CPU); requests that run short are preempted and "
                        "recomputed")
    g.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                   help="launch each greedy step before the previous one is committed (auto: on for CUDA)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=["dflash", "dspark"],
                   help="drafter family (default: dflash when --draft-model is given)")
    s.add_argument("--draft-model", default=None, help="drafter directory or hub id (turns speculation on)")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens verified per step (default: the drafter's block size - 1 for DFlash)")
    s.add_argument("--draft-sample-method", default=None, choices=["greedy", "probabilistic"])
    s.add_argument("--rejection-sample-method", default=None, choices=["standard", "block"])
    s.add_argument("--speculative-config", default=None, help="the whole speculative_config as JSON")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None, help="also print logprobs with N alternatives")


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    cfg: dict[str, Any] = json.loads(args.speculative_config) if args.speculative_config else {}
    if args.draft_model:
        cfg["model"] = args.draft_model
    if args.speculative_method:
        cfg["method"] = args.speculative_method
    if args.num_speculative_tokens is not None:
        cfg["num_speculative_tokens"] = args.num_speculative_tokens
    if args.draft_sample_method:
        cfg["draft_sample_method"] = args.draft_sample_method
    if args.rejection_sample_method:
        cfg["rejection_sample_method"] = args.rejection_sample_method
    if not cfg:
        return None
    cfg.setdefault("method", "dflash")
    return cfg


def sampling_params(args: argparse.Namespace) -> Any:
    from blockspec import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def build_llm(args: argparse.Namespace) -> Any:
    from blockspec import LLM

    return LLM(args.model, tokenizer=args.tokenizer, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, seed=args.seed, speculative_config=speculative_config(args),
               max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size,
               attention_backend=args.attention_backend, gpu_memory_utilization=args.gpu_memory_utilization,
               kv_page_size=args.kv_page_size, num_kv_pages=args.num_kv_pages,
               async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])


def format_spec_metrics(m: dict[str, Any]) -> str:
    if not m.get("num_drafts"):
        return "speculation: no drafts this run"
    per_pos = m["num_accepted_tokens_per_pos"]
    rates = " ".join(f"{n / m['num_drafts']:.2f}" for n in per_pos)
    return (f"speculation: mean acceptance length {m['mean_acceptance_length']:.2f}, acceptance rate "
            f"{m['acceptance_rate']:.1%} ({m['num_accepted_tokens']}/{m['num_draft_tokens']} drafts accepted over "
            f"{m['num_drafts']} steps)\n  per-position acceptance: {rates}")


def cmd_generate(args: argparse.Namespace, chat: bool = False) -> int:
    params = sampling_params(args)
    prompts: list[Any] = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            for line in f:
                if not line.strip():
                    continue
                record = json.loads(line) if line.lstrip().startswith("{") else line.rstrip("\n")
                prompts.append({"prompt_token_ids": record["prompt_token_ids"]}
                               if isinstance(record, dict) and "prompt_token_ids" in record
                               else record["prompt"] if isinstance(record, dict) else record)
    if not prompts:
        raise SystemExit("error: give at least one --prompt or --prompts-file")
    llm = build_llm(args)
    t0 = time.perf_counter()
    if chat or args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
    else:
        outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    dt = time.perf_counter() - t0
    ntok = 0
    for out in outs:
        for c in out.outputs:
            ntok += len(c.token_ids)
            print(f"--- {out.request_id} [{c.finish_reason}]" + (f" error: {out.error}" if out.error else ""))
            print(c.text)
            if c.logprobs:
                print("logprobs:", [(t, round(lp.logprob, 4)) for e in c.logprobs for t, lp in list(e.items())[:1]])
    m = llm.get_metrics()
    print(f"--- {ntok} tokens in {dt:.2f} s ({ntok / dt:.1f} tok/s)", file=sys.stderr)
    if llm.speculative_config is not None:
        print(format_spec_metrics(m), file=sys.stderr)
        print(f"  time split: draft {m.get('draft_s', 0):.3f} s, verify {m.get('verify_s', 0):.3f} s, "
              f"rest {m.get('rest_s', 0):.3f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="blockspec",
        description="Block-parallel speculative decoding (DFlash, DSpark) for Llama / Qwen models. "
                    "Output is exactly what plain decoding gives; drafting only makes it faster.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("generate", "generate text for one or more prompts"),
                           ("chat", "one chat turn per prompt, with the model's chat template")):
        p = sub.add_parser(name, help=helptext, description=helptext, epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_model_args(p)
        add_sampling_args(p)
        p.add_argument("--prompt", action="append", help="prompt text (repeatable: one batch)")
        p.add_argument("--prompts-file", default=None,
                       help="file with one prompt per line, or jsonl with 'prompt' or 'prompt_token_ids'")
        p.add_argument("--chat", action="store_true", help="apply the chat template")
    from blockspec.bench import add_bench_parser
    from blockspec.demo import add_demo_parser
    from blockspec.server import add_serve_parser
    from blockspec.train.trainer import build_arg_parser as build_train_parser, run_cli as run_train

    add_demo_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    train = sub.add_parser("train", help="train a DFlash or DSpark drafter for a target model",
                           description="Train a DFlash or DSpark drafter against a frozen target and export it in the "
                                       "z-lab (DFlash) or DeepSpec (DSpark) format that `--draft-model` loads.")
    build_train_parser(train).set_defaults(func=run_train)
    args = parser.parse_args(argv)
    from blockspec.errors import USER_ERRORS

    try:
        if args.command in ("generate", "chat"):
            return cmd_generate(args, chat=args.command == "chat")
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
