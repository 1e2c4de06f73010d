"""What the commands (`generate`, `chat`, `serve`, `demo`) share: the model, speculation and sampling
arguments, the LLM they build from them, and how speculation counters are printed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from blockspec.llm import LLM
from blockspec.sampling_params import SamplingParams


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


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=args.stop, stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def build_llm(args: argparse.Namespace) -> LLM:
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
