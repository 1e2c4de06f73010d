"""`blockspec` command line: generate, chat, demo, serve, bench, train.

Importing this module loads no torch: `main` imports the engine inside its Ctrl-C handling, so an interrupt in the
seconds torch takes to load ends with one line as an interrupt later does."""

from __future__ import annotations

import argparse
import io
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from blockspec import __version__
from blockspec.assets import embedded
from blockspec.config import ConfigError

if TYPE_CHECKING:
    from blockspec.llm import LLM

EXAMPLES = """examples:
  blockspec demo                                   # speculative decoding on the embedded default model
  blockspec generate Qwen/Qwen3-8B --prompt "Write a haiku" --max-tokens 64
  blockspec generate ./my-model --prompt "def fib(n):" \\
      --draft-model z-lab/Qwen3-8B-DFlash-b16 --num-speculative-tokens 15
  blockspec chat default --draft-model default     # a conversation on stdin, one turn a line
  blockspec chat ./my-model --prompt "Hello!" --temperature 0.7 --seed 1
  blockspec serve Qwen/Qwen3-8B -tp 2 --draft-model z-lab/Qwen3-8B-DFlash-b16
"""


def print_summary(llm: LLM, ntok: int, seconds: float) -> None:
    """Tokens per second, and with speculation configured what it did (or why it drafted nothing)."""
    from blockspec.cli_options import format_spec_metrics

    m = llm.get_stats()
    print(f"--- {ntok} tokens in {seconds:.2f} s ({ntok / max(seconds, 1e-9):.1f} tok/s)", file=sys.stderr)
    if llm.speculative_config is not None:
        print(format_spec_metrics(m), file=sys.stderr)
        print(f"  time split: draft {m.get('draft_s', 0):.3f} s, verify {m.get('verify_s', 0):.3f} s, "
              f"chained (draft, verify and acceptance in one graph) {m.get('chained_s', 0):.3f} s, "
              f"rest {m.get('rest_s', 0):.3f} s", file=sys.stderr)


def opening(args: argparse.Namespace) -> list[dict[str, str]]:
    """A conversation's first messages: the system prompt, where one is given."""
    return [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []


def cmd_chat_session(args: argparse.Namespace) -> int:
    """A conversation: each line of stdin is the user's next turn, answered with the whole conversation
    so far; a turn the model cannot take (too long for the context) is reported and dropped."""
    from blockspec.cli_options import build_llm, sampling_params
    from blockspec.errors import USER_ERRORS

    sampling_params(args)  # bad flags fail before the model loads
    if sys.stdin is None:  # started with stdin closed: no conversation to read
        raise ConfigError("chat without --prompt reads the conversation from stdin, which is closed")
    with build_llm(args) as llm:  # closed on the way out: a tensor-parallel LLM's rank processes stop
        params = sampling_params(args, llm.inputs.sampling_defaults)
        messages = opening(args)
        tty = sys.stdin.isatty()
        if tty:
            print("blockspec chat: one message a line; Ctrl-D ends the conversation", file=sys.stderr)
        ntok, t0 = 0, time.perf_counter()
        try:
            while True:
                if tty:
                    print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line:
                    break
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                try:
                    answer = llm.chat(messages, params, use_tqdm=False,
                                      chat_template_kwargs=args.chat_template_kwargs)[0].outputs[0]
                except USER_ERRORS as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    messages.pop()
                    continue
                ntok += len(answer.token_ids)
                print(answer.text, flush=True)
                messages.append({"role": "assistant", "content": answer.text})
        except KeyboardInterrupt:  # Ctrl-C ends the conversation as Ctrl-D does (an answer under way is dropped)
            print(file=sys.stderr)
        print_summary(llm, ntok, time.perf_counter() - t0)
    return 0


def cmd_generate(args: argparse.Namespace, chat: bool = False) -> int:
    from blockspec.cli_options import build_llm, format_logprobs, sampling_params
    from blockspec.inputs import read_prompts_file

    sampling_params(args)  # bad flags fail before the model loads
    prompts: list[Any] = list(args.prompt or [])
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file, "--prompts-file")
    if not prompts and chat:
        return cmd_chat_session(args)
    if not prompts:
        raise ConfigError("give at least one --prompt or --prompts-file" + (f" ({args.prompts_file} holds no "
                          "prompt)" if args.prompts_file else ""))
    ids = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if not (chat or args.chat) and (args.system_prompt or args.chat_template_kwargs):
        raise ConfigError("--system-prompt and --chat-template-kwargs shape a conversation: use them with chat or "
                          "--chat")
    if (chat or args.chat) and ids:
        raise ConfigError(f"chat takes text prompts; prompt {ids[0]} holds token ids (generate without --chat takes "
                          "them as given)")
    with build_llm(args) as llm:
        params = sampling_params(args, llm.inputs.sampling_defaults)
        t0 = time.perf_counter()
        if chat or args.chat:
            outs = llm.chat([opening(args) + [{"role": "user", "content": p}] for p in prompts], params,
                            use_tqdm=len(prompts) > 1, chat_template_kwargs=args.chat_template_kwargs)
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
                    print(f"logprobs (token logprob (rank) | top {params.logprobs}):")
                    print(format_logprobs(c.token_ids, c.logprobs, llm.get_tokenizer(), params.logprobs or 0))
        print_summary(llm, ntok, dt)
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from blockspec.engine.build import load_tokenizer
    from blockspec.models.fp8_export import calibration_sequences, write_fp8_checkpoint
    from blockspec.models.loader import resolve_device, resolve_model_dir

    resolve_device(args.device)  # a device that does not exist is named whether or not calibration uses it
    if args.kv_scales == "head" and not args.kv_calibration:
        raise ConfigError("--kv-scales head: per-head KV cache scales are calibrated; give --kv-calibration FILE")
    src = resolve_model_dir(embedded(args.model), revision=args.revision, download_dir=args.download_dir,
                            token=args.hf_token)
    calibration = None
    if args.kv_calibration:
        missing = [f for f in args.kv_calibration if not Path(f).is_file()]
        if missing:
            raise ConfigError(f"--kv-calibration: no such file: {', '.join(missing)}")
        tokenizer = load_tokenizer(src)
        if tokenizer is None:
            raise ConfigError(f"{src}: no tokenizer files; --kv-calibration tokenizes its text with the model's")
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.kv_calibration]
        calibration = calibration_sequences(tokenizer, texts, args.kv_calibration_tokens)
    done = write_fp8_checkpoint(src, Path(args.out), args.block_size, calibration, args.device,
                                per_head=args.kv_scales == "head")
    print(f"wrote {done.out}: {done.quantized} products in e4m3 ({args.block_size} x {args.block_size} blocks), "
          f"weights {done.bytes_before / 1e6:.1f} -> {done.bytes_after / 1e6:.1f} MB")
    if done.ragged:
        print(f"warning: {len(done.ragged)} products (e.g. {done.ragged[0]}) are not whole {args.block_size} x "
              f"{args.block_size} blocks: blockspec and transformers load them, vLLM's block-FP8 layers refuse such "
              "shapes", file=sys.stderr)
    if done.kv_scales is not None:
        scales = done.kv_scales.values()
        print(f"KV cache scales of {len(done.kv_scales.k)} layers{' per KV head' if args.kv_scales == 'head' else ''} "
              f"from {sum(map(len, calibration))} tokens: "
              f"{min(scales):.3g} to {max(scales):.3g} (|K| and |V| up to {max(scales) * 448:.3g})")
    return 0


# option names whose flags a user may have typed under another name (vLLM's)
FLAG_ALIASES = {"kv_page_size": "--block-size / --kv-page-size",
                "max_prefill_tokens": "--max-num-batched-tokens / --max-prefill-tokens"}


def flagged(message: str) -> str:
    """An error that opens with an option's name (an engine limit's, or SamplingParams.<field>=) with the flag
    that sets it named beside it, so `--block-size 0` is not answered in kv_page_size's words alone."""
    found = re.match(r"(SamplingParams\.)?([a-z_]+)[ =]", message)
    if found is None or "_" not in found.group(2) and not found.group(1):
        return message
    name = found.group(2)
    return f"{message} ({FLAG_ALIASES.get(name, '--' + name.replace('_', '-'))})"


def dashed_flags(argv: list[str]) -> list[str]:
    """vLLM's spelling rule: --max_model_len is --max-model-len (flag names only, never a value; `train` keeps its
    own parser's names)."""
    if argv[:1] == ["train"]:
        return argv
    return [a.split("=", 1)[0].replace("_", "-") + ("=" + a.split("=", 1)[1] if "=" in a else "")
            if a.startswith("--") else a for a in argv]


def tolerant_output() -> None:
    """Text the terminal's encoding cannot show (a model's output or a prompt under an ASCII or Windows code-page
    stdout) is printed escaped (\\u672c) rather than ending the command with a UnicodeEncodeError after the work."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


def main(argv: list[str] | None = None) -> int:
    tolerant_output()
    try:
        return run_command(argv)
    except KeyboardInterrupt:  # Ctrl-C: what was printed stands; the shell's code for SIGINT, no traceback
        print("interrupted", file=sys.stderr)
        return 130


def run_command(argv: list[str] | None) -> int:
    """The command `argv` (None: the process's arguments) names; a user's error is one line and exit code 2."""
    from blockspec.cli_options import HelpFormatter, add_model_args, add_sampling_args, json_object, settle_model

    parser = argparse.ArgumentParser(
        prog="blockspec",
        description="Block-parallel speculative decoding (DFlash, DSpark) for Llama / Qwen / Mistral models. "
                    "Greedy output is exactly plain decoding's, and sampled output keeps its distribution; "
                    "drafting only makes it faster.",
        epilog=EXAMPLES, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"blockspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("generate", "generate text for one or more prompts"),
                           ("chat", "a conversation read from stdin, one user turn a line, with the model's chat "
                                    "template; with --prompt, one turn per prompt")):
        p = sub.add_parser(name, help=helptext, description=helptext, epilog=EXAMPLES, formatter_class=HelpFormatter)
        add_model_args(p)
        add_sampling_args(p)
        p.add_argument("--prompt", action="append", help="prompt text (repeatable: one batch; default: none)")
        p.add_argument("--prompts-file", default=None,
                       help="a text file, one prompt a line; or a .jsonl file, one object a line with 'prompt' "
                            "or 'prompt_token_ids' (default: none)")
        p.add_argument("--chat", action="store_true", help="apply the chat template")
        p.add_argument("--system-prompt", default=None,
                       help="a system message opening each conversation (chat, or --chat; default: none)")
        p.add_argument("--chat-template-kwargs", type=json_object, default=None,
                       help="the chat template's variables as a JSON object, e.g. '{\"enable_thinking\": false}' "
                            "for Qwen3 (chat, or --chat; default: none)")
    from blockspec.bench import add_bench_parser
    from blockspec.demo import add_demo_parser
    from blockspec.models import fp8_export
    from blockspec.server import add_serve_parser
    from blockspec.train.trainer import build_arg_parser as build_train_parser, run_cli as run_train

    add_demo_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    q = sub.add_parser("quantize", help="write a model's FP8 checkpoint (e4m3 weights in 128 x 128 blocks)",
                       description=fp8_export.__doc__, formatter_class=HelpFormatter)
    q.add_argument("model", help="an HF model directory or hub id, or 'default' (the embedded target)")
    q.add_argument("--out", required=True, help="the FP8 checkpoint's directory (new or empty)")
    q.add_argument("--block-size", type=int, default=fp8_export.BLOCK,
                   help=f"rows and columns a weight scale covers (default: {fp8_export.BLOCK})")
    q.add_argument("--revision", default=None, help="the model's branch, tag or commit on the hub (default: its "
                                                     "default branch)")
    q.add_argument("--download-dir", default=None, help="where hub downloads go (default: the Hugging Face cache)")
    q.add_argument("--hf-token", default=None, help="the hub token for gated or private models (default: "
                                                     "huggingface_hub's, e.g. HF_TOKEN)")
    q.add_argument("--kv-calibration", action="append", default=None, metavar="FILE",
                   help="a text file to calibrate the FP8 KV cache scales on (repeatable; default: none, and no "
                        "scales are written: an FP8 cache then stores at scale 1.0)")
    q.add_argument("--kv-calibration-tokens", type=int, default=fp8_export.CALIBRATION_TOKENS,
                   help=f"tokens of the calibration text prefilled, in prefills of at most "
                        f"{fp8_export.CALIBRATION_LENGTH} (default: {fp8_export.CALIBRATION_TOKENS})")
    q.add_argument("--kv-scales", choices=("tensor", "head"), default="tensor",
                   help="calibrated scales: one K and one V scale a layer (tensor, what every engine reads from an "
                        "fp8 checkpoint) or one a KV head (head: a head of small keys keeps its precision beside "
                        "one of large keys; default: tensor)")
    q.add_argument("--device", default="auto", help="where calibration runs (default: auto, a GPU if there is one)")
    q.set_defaults(func=cmd_quantize)
    train = sub.add_parser("train", help="train a DFlash or DSpark drafter for a target model",
                           description="Train a DFlash or DSpark drafter against a frozen target and export it in the "
                                       "z-lab (DFlash) or DeepSpec (DSpark) format that `--draft-model` loads.")
    build_train_parser(train).set_defaults(func=run_train)
    args = parser.parse_args(dashed_flags(sys.argv[1:] if argv is None else argv))
    from blockspec.errors import USER_ERRORS

    try:
        if hasattr(args, "model_tag"):
            settle_model(args)
        if args.command in ("generate", "chat"):
            return cmd_generate(args, chat=args.command == "chat")
        return args.func(args)
    except USER_ERRORS as exc:
        print(f"error: {flagged(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
