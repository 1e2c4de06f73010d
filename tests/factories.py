"""Tiny randomly initialised Hugging Face checkpoints of each supported family, written by transformers,
an LLM with injected faults for the server's tests, and the Triton checks every kernel test shares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

FAMILIES = ("llama", "qwen2", "qwen3")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
TRITON_SKIP_REASON = "needs triton >= 3.9 (its interpreter runs the kernels on the CPU)"


def triton_interpretable() -> bool:
    """Triton kernels can run here: on a GPU, or on the CPU through an interpreter that handles
    scalar loop bounds (triton >= 3.9)."""
    try:
        import triton
    except ImportError:
        return False
    if torch.cuda.is_available():
        return True
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


def acceptance_cases(seed: int, r: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows whose ids mostly repeat the drafts (long accepted prefixes), with drafts cut short by -1,
    ids outside the vocabulary, bad rows (-1) before and after the draft's end, and lengths 0..k."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, vocab, (r, k), generator=g)
    ids = torch.randint(0, vocab, (r, k + 1), generator=g)
    same = torch.rand(r, k, generator=g) < 0.8
    ids[:, :k] = torch.where(same, drafts, ids[:, :k])
    lens = torch.randint(0, k + 1, (r,), generator=g)
    drafts[torch.rand(r, k, generator=g) < 0.05] = -1
    drafts[torch.rand(r, k, generator=g) < 0.05] = vocab + 3
    ids[torch.rand(r, k + 1, generator=g) < 0.04] = -1
    return ids, drafts, lens


def hf_config(family: str, vocab: int = 96, hidden: int = 64, layers: int = 4, heads: int = 4, kv_heads: int = 2,
              head_dim: int | None = None, tie: bool = False, **extra):
    """A transformers config object for a tiny model of `family`."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=0, pad_token_id=None)
    if head_dim is not None:
        common["head_dim"] = head_dim
    common.update(extra)
    if family == "llama":
        common.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        common.setdefault("rope_theta", 500000.0)
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        common.setdefault("rope_theta", 1000000.0)
        return transformers.Qwen2Config(**common)
    if family == "qwen3":
        common.setdefault("rope_theta", 1000000.0)
        common.setdefault("head_dim", 32)
        return transformers.Qwen3Config(**common)
    if family in MOE_FAMILIES:  # 8 experts, top-2, expert width 24; every layer sparse unless told
        common.setdefault("rope_theta", 1000000.0)
        common.setdefault("num_experts", 8)
        common.setdefault("num_experts_per_tok", 2)
        common.setdefault("moe_intermediate_size", 24)
        if family == "qwen3_moe":
            common.setdefault("head_dim", 32)
            return transformers.Qwen3MoeConfig(**common)
        common.setdefault("shared_expert_intermediate_size", 40)
        return transformers.Qwen2MoeConfig(**common)
    raise ValueError(family)


def make_hf_model(family: str, seed: int = 0, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **kw)
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2_moe": transformers.Qwen2MoeForCausalLM}[family]
    model = cls(cfg).eval()
    with torch.no_grad():  # wider weights than the default init, so greedy paths are not trivially flat
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # 3-D: transformers 5's stacked experts
                p.normal_(0, 0.08 if "embed" not in name else 0.5)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0, 0.02)
    return model


def save_tiny(path: Path, family: str = "qwen3", seed: int = 0, max_shard_size: str | None = None,
              stacked_experts: bool = False, **kw) -> Path:
    """Write a tiny HF checkpoint (config, safetensors, generation config) to `path` and return it. MoE
    experts are written one by one, as the hub checkpoints hold them, or with `stacked_experts` as
    transformers 5 holds them in memory (3-D gate_up_proj / down_proj)."""
    model = make_hf_model(family, seed, **kw)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    if stacked_experts:
        kwargs["save_original_format"] = False
    model.save_pretrained(path, **kwargs)
    return Path(path)


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def save_tiny_tokenizer(path: Path, drop: str = "", think: bool = False) -> Path:
    """A character-level tokenizer over printable ASCII: id 0 = <s>, 1 = </s> (EOS), chars from 2 (98 ids;
    fewer without the characters in `drop`); with `think`, <think> and </think> after them, one token each
    (a thinking model's tags)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127) if chr(c) not in drop] + ["\n"]
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if think:
        fast.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return Path(path)


def save_tiny_model_with_tokenizer(path: Path, family: str = "qwen3", seed: int = 0, **kw) -> Path:
    """Tiny checkpoint (vocab 128) plus the character tokenizer: enough for text-level tests."""
    save_tiny(path, family, seed, vocab=128, **kw)
    save_tiny_tokenizer(path)
    return Path(path)


# The tiny target the drafter fixtures in tests/fixtures/drafters were built for.
DRAFTER_TARGET_KW = dict(vocab=96, hidden=32, layers=5, heads=4, kv_heads=2, head_dim=8)


def save_drafter_target(path: Path, tokenizer: bool = False, think: bool = False) -> Path:
    """The fixtures' target checkpoint (qwen3, seed 0): the drafter fixtures fit it. With `tokenizer`, a
    character tokenizer of its 96 ids (printable ASCII but '`' and '~'); with `think`, one whose last two ids
    are <think> and </think> (printable ASCII but '`', '~', '^' and '|')."""
    save_tiny(path, "qwen3", seed=0, **DRAFTER_TARGET_KW)
    if tokenizer or think:
        save_tiny_tokenizer(path, drop="`~^|" if think else "`~", think=think)
    return Path(path)


def save_moe_target(path: Path, family: str = "qwen3_moe") -> Path:
    """A mixture-of-experts target of the fixtures' shape (so the drafter fixtures fit it): 5 layers, the
    middle one dense (mlp_only_layers), the others 8 experts, top-2, renormalised."""
    save_tiny(path, family, seed=0, mlp_only_layers=[2], norm_topk_prob=True, **DRAFTER_TARGET_KW)
    return Path(path)


FAIL_PROMPT = "simulate a device failure"


def llm_with_faults(step_delay: float = 0.0, **llm_kwargs):
    """An LLM whose engine steps take `step_delay` s longer (so a request is surely still running when its
    client leaves) and whose target forwards raise, as a device error would, whenever their batch holds
    a request with the prompt FAIL_PROMPT. Module-level, so a server can load it in its engine process
    (functools.partial pickles it)."""
    from blockspec import LLM

    llm = LLM(**llm_kwargs)
    engine, runner, step = llm.engine, llm.engine.runner, llm.engine.step

    def failing(forward, slots_at: int):
        def run(*args, **kwargs):
            slots = set(args[slots_at])
            if any(r.prompt == FAIL_PROMPT and r.slot in slots for r in engine.running):
                raise RuntimeError("simulated device failure")
            return forward(*args, **kwargs)
        return run

    def slow_step():
        time.sleep(step_delay)
        return step()

    runner.forward = failing(runner.forward, 2)  # forward(runs, starts, slots, ...)
    runner.forward_ids = failing(runner.forward_ids, 3)  # forward_ids(ids, query_lens, starts, slots, ...)
    engine.step = slow_step
    return llm


FRONT_END = """
import importlib, json, sys
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from blockspec.kernels.sm90 import source

module = importlib.import_module(sys.argv[1])
target = GPUTarget("cuda", 90, 32)
backend = CUDABackend(target)
options = backend.parse_options({})
for kernel, signature, constexprs in json.loads(sys.argv[2]):
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source(getattr(module, kernel), signature, constexprs).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
"""


TO_PTX = """
import importlib, json, sys
from blockspec.kernels.sm90 import compile_sm90

module = importlib.import_module(sys.argv[1])
print(json.dumps([compile_sm90(getattr(module, kernel), signature, constexprs, {"launch_pdl": True}).asm["ptx"]
                  for kernel, signature, constexprs in json.loads(sys.argv[2])]))
"""


SHARED = """
import importlib, json, sys
from blockspec.kernels.sm90 import compile_sm90

module = importlib.import_module(sys.argv[1])
print(json.dumps([compile_sm90(getattr(module, kernel), signature, constexprs, options, aligned=True,
                               divisible=tuple(divisible)).metadata.shared
                  for kernel, signature, constexprs, options, divisible in json.loads(sys.argv[2])]))
"""


def _sm90(script: str, module: str, cases: list[tuple[str, dict[str, str], dict[str, object]]]) -> str:
    import pytest

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script, module, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def compile_for_sm90(module: str, cases: list[tuple[str, dict[str, str], dict[str, object]]]) -> None:
    """Triton's front end (AST -> TTIR) for sm_90 over each (kernel, signature, constexprs) of `module`:
    it needs no GPU and type-checks what the interpreter does not. Arguments not in the signature are
    i32. Run in a fresh interpreter, since TRITON_INTERPRET replaces the language the front end compiles."""
    _sm90(FRONT_END, module, cases)


def shared_for_sm90(module: str, cases: list[tuple[str, dict[str, str], dict[str, object], dict, list[str]]]
                    ) -> list[int]:
    """The shared memory (bytes) a program of each (kernel, signature, constexprs, launch options,
    integer arguments divisible by 16) of `module` takes on sm_90, compiled as `compile_for_sm90` does;
    pointers and strides aligned, as a launch with aligned tensors has them."""
    return json.loads(_sm90(SHARED, module, cases))


def ptx_for_sm90(module: str, cases: list[tuple[str, dict[str, str], dict[str, object]]]) -> list[str]:
    """Each case of `compile_for_sm90` compiled to PTX for sm_90, launched with programmatic dependent
    launch (no GPU needed: Triton's LLVM and the bundled ptxas)."""
    return json.loads(_sm90(TO_PTX, module, cases))


def assert_incremental_matches_full(model, length: int, chunks: tuple[int, ...], vocab: int = 96) -> None:
    """A cache written in chunks of different sizes (one-row decode steps among them) gives the logits
    of one pass over the same ids."""
    from blockspec.models.kv_cache import causal_meta

    assert sum(chunks) == length
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(3, 64)
    types = model.config.layer_types
    full = model.compute_logits(model(ids, causal_meta([0], [0], [length], length, cache.trash, "cpu",
                                                       layer_types=types), cache)[0])
    pieces, start = [], 0
    for n in chunks:
        meta = causal_meta([2], [start], [n], n, cache.trash, "cpu", layer_types=types)
        pieces.append(model.compute_logits(model(ids[:, start: start + n], meta, cache)[0]))
        start += n
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-4


# the kernels whose compiled variants the GPU warm-up test watches (module under blockspec.kernels, kernel name)
WATCHED_KERNELS = [("attention", "_block_attention"), ("ops", "_rms_norm"), ("ops", "_silu_mul"),
                   ("ops", "_qkv_rope_store"), ("ops", "_skinny_linear"), ("gumbel", "_split_argmax"),
                   ("gumbel", "_merge_splits")]


def watched_kernels() -> list:
    """WATCHED_KERNELS' Triton kernels (an AttributeError names one renamed or gone)."""
    import importlib

    return [getattr(importlib.import_module(f"blockspec.kernels.{module}"), name) for module, name in WATCHED_KERNELS]
