"""`blockspec` command line: generate, chat, demo, serve, bench, train."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from blockspec.cli_options import (
    add_model_args,
    add_sampling_args,
    build_llm,
    format_spec_metrics,
    sampling_params,
)

EXAMPLES = """examples:
  blockspec demo                                   # speculative decoding on the embedded default model
  blockspec generate --model Qwen/Qwen3-8B --prompt "Write a haiku" --max-tokens 64
  blockspec generate --model ./my-model --prompt "def fib(n):" \\
      --draft-model z-lab/Qwen3-8B-DFlash-b16 --num-speculative-tokens 15
  blockspec chat --model ./my-model --prompt "Hello!" --temperature 0.7 --seed 1
"""


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
