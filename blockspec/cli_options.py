"""What the commands (`generate`, `chat`, `serve`, `demo`) share: the model, speculation and sampling
arguments, the LLM they build from them, and how speculation counters are printed."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from blockspec.assets import embedded
from blockspec.config import LOGPROBS_MODES, REASONING_PARSERS, ConfigError, EngineArgs, EngineConfig, infer_method
from blockspec.llm import LLM
from blockspec.request import Logprob
from blockspec.sampling_params import SamplingParams


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (argparse type): refused before anything loads, not by the socket after."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer 0-65535, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {value}")
    return value


def token_count(text: str) -> int:
    """A count of tokens in vLLM's human-readable form (argparse type): 2048, 1k = 1,000, 25.6k = 25,600,
    1K = 1,024 (binary suffixes take whole numbers only); m / M, g / G likewise; "auto" is -1."""
    if text.strip() == "auto":
        return -1
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, or one with a suffix k / m / g (x 1000) or "
                                             f"K / M / G (x 1024), like 32k or 8K; got {text!r}") from None
    number, suffix = match.groups()
    power = "kmg".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000**power)
    if "." in number:
        raise argparse.ArgumentTypeError(f"binary suffixes take whole numbers ({text!r}); did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024**power


def json_object(text: str) -> dict[str, Any]:
    """An option's JSON object (argparse reports the option and this line where it is not one)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object ({{...}}), got {text!r}")
    return value


def json_strings(text: str) -> list[str]:
    """An option's JSON list of strings (vLLM's form for --allowed-origins and its kin)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings ([\"...\"]), got {text!r}")
    return value


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, unless the help already says it in words, "(default: the
    model's)", as it must where the default is None and means something."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default:" in text or "(default" in text or action.default in (None, argparse.SUPPRESS) \
                or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the target model: a Hugging Face directory or hub id, or 'default' (the embedded default "
                        "model); or give it as --model")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="the target model, as the MODEL argument (one of the two is required)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)")
    g.add_argument("--revision", default=None, help="the model's branch, tag or commit on the hub (default: its "
                                                     "default branch; the drafter's: speculative_config's revision)")
    g.add_argument("--tokenizer-revision", default=None, help="--tokenizer's branch, tag or commit on the hub (default: its default branch; "
                                                                 "without --tokenizer the model's own files are used)")
    g.add_argument("--download-dir", default=None, help="where hub downloads go (default: the Hugging Face cache)")
    g.add_argument("--hf-token", default=None, help="the hub token for gated or private models (default: "
                                                     "huggingface_hub's, e.g. HF_TOKEN)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: quantize the decoder layers' weights at load to FP8 (e4m3, per-channel scales; "
                        "embeddings and LM head stay in --dtype); FP8 checkpoints load as FP8 without it "
                        "(default: none)")
    g.add_argument("--kv-cache-dtype", default=EngineConfig.kv_cache_dtype, choices=["auto", "fp8", "fp8_e4m3"],
                   help="the target's and the drafter's KV cache: auto (the model's dtype) or fp8 (e4m3: half the "
                        "bytes per cached token; scaled by the checkpoint's calibrated k_scale / v_scale, per layer "
                        "or per head, else 1.0)")
    g.add_argument("--logprobs-mode", default=EngineConfig.logprobs_mode, choices=list(LOGPROBS_MODES),
                   help="what a sampled token's logprobs are: raw_logprobs, of the raw logits (as vLLM's default); "
                        "raw_logits, the raw logits; or processed_logprobs, of the distribution it was sampled from "
                        "(temperature, penalties, top-k/p, masks)")
    g.add_argument("--max-logprobs", type=int, default=EngineConfig.max_logprobs,
                   help="the most logprobs a request may ask for a token (-1: the whole vocabulary)")
    g.add_argument("--max-model-len", type=token_count, default=None,
                   help="context length to plan memory for (default: the model's, at most 4096); 32k or 8K as vLLM "
                        "takes them; -1 or auto: the model's whole length")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs, help="requests decoded together at most")
    g.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", dest="max_prefill_tokens", type=token_count,
                   default=EngineConfig.max_prefill_tokens,
                   help="prompt tokens one step prefills at most (longer prompts are chunked); "
                        "--max-num-batched-tokens is vLLM's name for it (the running requests' decode rows come on "
                        "top of it here)")
    g.add_argument("--graph-prefill-tokens", type=int, default=EngineConfig.graph_prefill_tokens,
                   help="on CUDA with the Triton attention kernel, prefill batches of at most this many padded tokens "
                        "replay CUDA graphs captured at start-up (0: eager prefill)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="split the target across N ranks")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "sdpa"],
                   help="auto: the Triton kernel on CUDA when triton is installed, else PyTorch SDPA")
    g.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.gpu_memory_utilization,
                   help="share of the GPU's memory the engine may hold (weights, KV caches, activations)")
    g.add_argument("--kv-page-size", "--block-size", dest="kv_page_size", type=int, default=EngineConfig.kv_page_size,
                   help="positions a KV cache page holds (--block-size: vLLM's name)")
    g.add_argument("--num-kv-pages", type=int, default=None,
                   help="KV pages to allocate (default: what --gpu-memory-utilization leaves on CUDA, enough for "
                        "max-num-seqs x max-model-len on the CPU); requests that run short are preempted and "
                        "recomputed")
    g.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"], nargs="?", const="on",
                   help="launch each greedy step before the previous one is committed (auto: on for CUDA; the flag "
                        "alone, as vLLM's: on)")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const", const="off",
                   help="the same as --async-scheduling off (vLLM's)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (target decode and prefill, the draft step, the chained speculative step): "
                        "slower steps, faster start-up")
    g.add_argument("--chat-template", default=None,
                   help="a chat template file, or the Jinja template itself, used instead of the tokenizer's "
                        "(default: the tokenizer's)")
    g.add_argument("--reasoning-parser", choices=list(REASONING_PARSERS), default=None,
                   help="how a thinking model's <think> block is read: structured outputs constrain the answer after "
                        "it, and the server returns it as the message's reasoning_content (default: %(default)s, no "
                        "block: the thinking is content and a grammar holds it too)")
    g.add_argument("--generation-config", default=EngineArgs.generation_config,
                   help="default sampling parameters: 'auto' reads the model's generation_config.json "
                        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), 'vllm' ignores "
                        "it, or a directory with one")
    g.add_argument("--tokenizer-mode", default=EngineArgs.tokenizer_mode, choices=["auto", "hf"],
                   help="vLLM's tokenizer choice: the fast tokenizer either way")
    g.add_argument("--task", "--runner", dest="task", default=EngineArgs.task, choices=["auto", "generate"],
                   help="vLLM's model task / runner: text generation either way")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's sake and ignored: blockspec runs no code from a model's repository")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="accepted for vLLM's sake: blockspec always prefills long prompts in chunks of "
                        "--max-prefill-tokens beside the running decodes")
    g.add_argument("--swap-space", type=float, default=None,
                   help="accepted for vLLM's sake and ignored: preempted requests are recomputed, not swapped")
    g.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="accepted for vLLM's sake and ignored: ranks all-reduce through torch.distributed")
    g.add_argument("--max-seq-len-to-capture", type=int, default=None,
                   help="accepted for vLLM's sake and ignored: decode graphs serve every context length")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="remember full KV pages by their tokens, so prompts that start alike skip prefilling "
                        "them (vLLM's automatic prefix caching; default: off)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--speculative-method", default=None, choices=["dflash", "dspark"],
                   help="drafter family (default: a local --draft-model's own, else dflash: name it for a hub "
                        "DSpark drafter); for the embedded target "
                        "'default' it alone turns speculation on with that family's embedded drafter")
    s.add_argument("--draft-model", default=None,
                   help="drafter directory or hub id, or 'default' (the embedded drafter of --speculative-method); "
                        "turns speculation on (default: none, plain decoding)")
    s.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="draft tokens verified per step at most (default: the drafter's draft positions: its block less "
                        "the anchor for DFlash, the whole block for DSpark)")
    s.add_argument("--adaptive-draft-length", action=argparse.BooleanOptionalAction, default=None,
                   help="each step verifies the number of drafts with the most measured tokens per second, down to "
                        "none (default: on); --no-adaptive-draft-length pins it to --num-speculative-tokens")
    s.add_argument("--draft-sample-method", default=None, choices=["greedy", "probabilistic"],
                   help="how drafts are drawn (default: greedy)")
    s.add_argument("--rejection-sample-method", default=None, choices=["standard", "block"],
                   help="how sampled drafts are verified (default: standard)")
    s.add_argument("--speculative-config", type=json_object, default=None,
                   help="the whole speculative_config as JSON (default: none; the flags above override its fields)")


CLI_SAMPLING = {"max_tokens": 128, "temperature": 0.0}
"""Where the command line's defaults differ from SamplingParams': more than 16 tokens, and greedy decoding."""

FROM_MODEL = "the model's generation_config.json where it sets it"


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens to generate at most (default: {FROM_MODEL}, else {CLI_SAMPLING['max_tokens']})")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end it")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"0 = greedy (default: {FROM_MODEL}, else {CLI_SAMPLING['temperature']:g})")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus sampling: the smallest set with this probability (default: {FROM_MODEL}, else 1)")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the k most likely tokens, 0 or -1 = off (default: {FROM_MODEL}, else off)")
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below this fraction of the top probability (default: {FROM_MODEL}, else 0)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted from tokens already generated")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtracted per occurrence of tokens already generated")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"divides the logits of tokens in the prompt or the output, 1 = off (default: {FROM_MODEL}, "
                        "else off)")
    g.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same tokens (default: none)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")
    g.add_argument("--stop-token-ids", type=int, nargs="*", default=None, help="token ids that end the output "
                                                                               "(default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--logprobs", type=int, default=None,
                   help="print each token's text, logprob and rank with its N most likely alternatives "
                        "(default: none)")


def settle_model(args: argparse.Namespace) -> None:
    """The target as given by the MODEL argument or --model (one of them, or both alike)."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}; give one")
    args.model = args.model or args.model_tag
    if args.model is None:
        raise ConfigError("give the target model: MODEL (a directory, a hub id or 'default') or --model")


def speculative_config(args: argparse.Namespace) -> dict[str, Any] | None:
    cfg: dict[str, Any] = dict(args.speculative_config or {})
    if args.draft_model:
        cfg["model"] = args.draft_model
    if args.adaptive_draft_length is not None:
        cfg["adaptive_draft_length"] = args.adaptive_draft_length
    if args.speculative_method:
        cfg["method"] = args.speculative_method
    if args.num_speculative_tokens is not None:
        cfg["num_speculative_tokens"] = args.num_speculative_tokens
    if args.draft_sample_method:
        cfg["draft_sample_method"] = args.draft_sample_method
    if args.rejection_sample_method:
        cfg["rejection_sample_method"] = args.rejection_sample_method
    if not cfg:
        if args.speculative_config == {}:  # asked for, yet naming nothing: it ran plain decoding without a word
            raise ConfigError("--speculative-config {} names no drafter: give at least 'method' and 'model' (or "
                              "leave the flag out for plain decoding)")
        return None
    if "model" not in cfg:  # a method named for the embedded target: its embedded drafter of that method
        if "method" not in cfg or args.model != "default":
            raise ConfigError("speculation needs its drafter: --draft-model DIR_OR_HUB_ID (or 'model' in "
                              "--speculative-config; with the embedded target 'default', --speculative-method "
                              "alone takes its embedded drafter)")
        cfg["model"] = "default"
    if "method" not in cfg:  # the checkpoint says which family it is, else DFlash
        cfg["method"] = infer_method(str(cfg["model"]), cfg.get("revision"), args.download_dir, args.hf_token)
    if isinstance(cfg["model"], str):
        cfg["model"] = embedded(cfg["model"], cfg["method"])
    return cfg


def sampling_params(args: argparse.Namespace, model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The flags' sampling parameters: a flag given wins, then the model's generation_config.json values
    (`model_defaults`, as `LLM.generate` takes them), then the command line's own defaults."""
    flags = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_tokens}
    values = {**CLI_SAMPLING, **(model_defaults or {}), **{k: v for k, v in flags.items() if v is not None}}
    return SamplingParams(
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, seed=args.seed,
        min_tokens=args.min_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
        logprobs=args.logprobs, **values,
    )


def build_llm(args: argparse.Namespace) -> LLM:
    return LLM(args.model, tokenizer=args.tokenizer, revision=args.revision,
               tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir, hf_token=args.hf_token,
               dtype=args.dtype, device=args.device,
               quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
               max_model_len=args.max_model_len, seed=args.seed, speculative_config=speculative_config(args),
               max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens,
               graph_prefill_tokens=args.graph_prefill_tokens, logprobs_mode=args.logprobs_mode,
               max_logprobs=args.max_logprobs, tensor_parallel_size=args.tensor_parallel_size,
               attention_backend=args.attention_backend, gpu_memory_utilization=args.gpu_memory_utilization,
               kv_page_size=args.kv_page_size, num_kv_pages=args.num_kv_pages,
               async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
               enforce_eager=args.enforce_eager, chat_template=args.chat_template,
               reasoning_parser=args.reasoning_parser,
               generation_config=args.generation_config, trust_remote_code=args.trust_remote_code,
               tokenizer_mode=args.tokenizer_mode, task=args.task,
               enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
               swap_space=args.swap_space, disable_custom_all_reduce=args.disable_custom_all_reduce,
               max_seq_len_to_capture=args.max_seq_len_to_capture)


def why_no_drafts(m: dict[str, Any]) -> str:
    """Why a run with speculation configured drafted nothing, from the engine's counters."""
    chosen = m.get("policy_steps", {})
    parked = m.get("num_parked_requests", 0)
    if parked or (chosen and not any(k for k, n in chosen.items() if n)):
        return ("speculation: configured, but the draft-length policy chose plain decoding for every step"
                + (f" ({parked} requests joined a batch size where plain decoding won)" if parked else "")
                + " (adaptive_draft_length=false pins K)")
    if any(k and n for k, n in chosen.items()):  # the policy chose drafts; each request's budget left none
        return ("speculation: configured, but no step drafted: the steps that chose drafts had no room left for "
                "any (max_tokens or the context ended the requests first)")
    return ("speculation: configured, but no step drafted (every request opted out with use_speculation=False, the "
            "batch was over max_batch_for_speculation, or no request decoded past its first token)")


def format_spec_metrics(m: dict[str, Any]) -> str:
    if not m.get("num_drafts"):
        return why_no_drafts(m)
    per_pos = m["num_accepted_tokens_per_pos"]
    rates = " ".join(f"{n / m['num_drafts']:.2f}" for n in per_pos)
    return (f"speculation: mean acceptance length {m['mean_acceptance_length']:.2f}, acceptance rate "
            f"{m['acceptance_rate']:.1%} ({m['num_accepted_tokens']}/{m['num_draft_tokens']} drafts accepted over "
            f"{m['num_drafts']} steps)\n  per-position acceptance: {rates}")


def format_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], tokenizer: Any, top_n: int) -> str:
    """One line per generated token: its text, logprob and rank, then the top_n alternatives (by rank)."""

    def text(tok: int) -> str:
        return repr(tokenizer.decode([tok])) if tokenizer is not None else f"id {tok}"

    lines = []
    for tok, entry in zip(token_ids, entries):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda item: item[1].rank)
        alternatives = ", ".join(f"{text(t)} {lp.logprob:.4f}" for t, lp in top)
        lines.append(f"  {text(tok)} {entry[tok].logprob:.4f} (rank {entry[tok].rank})"
                     + (f" | top {top_n}: {alternatives}" if top_n else ""))
    return "\n".join(lines)
