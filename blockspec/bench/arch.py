"""Model shapes with random weights, built in memory: real sizes (and real timings) without downloads.

`qwen3-8b` is Qwen3-8B (36 layers, hidden 4096, vocab 151936) with a Qwen3-8B-DFlash-b16-shaped drafter
(5 layers, block 16, taps [1, 9, 17, 25, 33]) and a DeepSpec dspark_qwen3_8b_block7-shaped DSpark
drafter (same backbone, anchor-first, vanilla Markov head rank 256, confidence head). `qwen3-30b-a3b` is
Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of width 768, top-8, renormalised) with a drafter of
z-lab/Qwen3-Coder-30B-A3B-DFlash's shape (8 layers, block 16, taps [1, 12, 23, 34, 45]) and DSpark heads
as qwen3-8b's. `tiny` and `tiny-moe` are the dense and sparse layouts at toy size, for CPU tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from blockspec.config import ConfigError, ModelConfig, RopeConfig
from blockspec.models.layers import Rotary
from blockspec.models.llama import CausalLM
from blockspec.models.moe import Experts
from blockspec.models.quant import Fp8Experts
from blockspec.drafters import DFlashDraft, DSparkDraft, DSparkHeads, DraftModel, DrafterConfig

QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
                       layer_types=("full_attention",) * 36, torch_dtype="bfloat16", eos_token_ids=(151645,))

QWEN3_8B_DFLASH = DrafterConfig(hidden_size=4096, intermediate_size=12288, num_layers=5, num_heads=32, num_kv_heads=8,
                                head_dim=128, vocab_size=151936, block_size=16, mask_token_id=151669,
                                target_layer_ids=(1, 9, 17, 25, 33), target_hidden_size=4096,
                                rope=QWEN3_8B.rope, max_position_embeddings=40960)

QWEN3_30B_A3B = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
                            layer_types=("full_attention",) * 48, torch_dtype="bfloat16", eos_token_ids=(151645,),
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                            moe_layers=tuple(range(48)))

# the dense model that reads per decode step what QWEN3_30B_A3B's plain step does: its attention, and one
# SwiGLU MLP as wide as the 8 experts a row routes to (the router's 0.4 % aside); the MoE's batch baseline
QWEN3_30B_A3B_DENSE = dataclasses.replace(
    QWEN3_30B_A3B, model_type="qwen3", intermediate_size=QWEN3_30B_A3B.num_experts_per_tok
    * QWEN3_30B_A3B.moe_intermediate_size, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
    norm_topk_prob=False, moe_layers=())

# z-lab/Qwen3-Coder-30B-A3B-DFlash (the public drafter of this family): a Qwen3 backbone of the target's
# width with a dense MLP of the target's intermediate_size (RoPE theta 1e7 there, for the Coder target's
# context; it does not change a step's cost)
QWEN3_30B_A3B_DFLASH = DrafterConfig(hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=32,
                                     num_kv_heads=4, head_dim=128, vocab_size=151936, block_size=16,
                                     mask_token_id=151669, target_layer_ids=(1, 12, 23, 34, 45),
                                     target_hidden_size=2048, rope=QWEN3_30B_A3B.rope, max_position_embeddings=40960)

TINY = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=136, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope=RopeConfig(theta=1e6),
                   max_position_embeddings=4096, qk_norm=True, layer_types=("full_attention",) * 4,
                   torch_dtype="float32", eos_token_ids=(1,))

TINY_MOE = dataclasses.replace(TINY, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                               moe_intermediate_size=32, norm_topk_prob=True, moe_layers=(0, 1, 3))

TINY_DFLASH = DrafterConfig(hidden_size=64, intermediate_size=136, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=16, vocab_size=512, block_size=8, mask_token_id=511, target_layer_ids=(0, 2),
                            target_hidden_size=64, rope=TINY.rope, max_position_embeddings=4096)


@dataclass(frozen=True)
class Arch:
    """A target shape and its two drafter shapes; `init_std` is the std of the random matrices."""

    name: str
    target: ModelConfig
    dflash: DrafterConfig
    dspark_block_size: int
    dspark_heads: DSparkHeads
    init_std: float

    def dspark(self, block_size: int | None = None) -> DrafterConfig:
        """The DSpark drafter: the DFlash backbone, anchor-first (block_size drafts per step)."""
        return dataclasses.replace(self.dflash, block_size=block_size or self.dspark_block_size, anchor_first=True)


ARCHS = {
    "qwen3-8b": Arch("qwen3-8b", QWEN3_8B, QWEN3_8B_DFLASH, 7, DSparkHeads(markov_rank=256), 0.02),
    # wider weights at toy size, so greedy choices are not near-ties (the transformers cross-check is exact)
    "tiny": Arch("tiny", TINY, TINY_DFLASH, 8, DSparkHeads(markov_rank=16), 0.08),
    "qwen3-30b-a3b": Arch("qwen3-30b-a3b", QWEN3_30B_A3B, QWEN3_30B_A3B_DFLASH, 7, DSparkHeads(markov_rank=256), 0.02),
    "qwen3-30b-a3b-dense": Arch("qwen3-30b-a3b-dense", QWEN3_30B_A3B_DENSE, QWEN3_30B_A3B_DFLASH, 7,
                                DSparkHeads(markov_rank=256), 0.02),
    "tiny-moe": Arch("tiny-moe", TINY_MOE, TINY_DFLASH, 8, DSparkHeads(markov_rank=16), 0.08),
}


def get_arch(name: str) -> Arch:
    if name not in ARCHS:
        raise ConfigError(f"--arch {name!r} unknown; available: {', '.join(ARCHS)}")
    return ARCHS[name]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _randomize(model: nn.Module, std: float, seed: int) -> None:
    """Normal(0, std) for every matrix and stacked experts (norm weights stay 1, biases 0), seeded."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, std, generator=gen)


def random_target(cfg: ModelConfig, max_positions: int, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16, std: float = 0.02, seed: int = 0) -> CausalLM:
    """The target with random weights; RoPE tables stay fp32 as load_target keeps them."""
    with torch.device(device), default_dtype(dtype):  # built in place: no fp32 copy of 8B parameters
        model = CausalLM(cfg, max_positions)
    model.rotary = Rotary(cfg.rope, cfg.head_dim, max_positions).to(device)
    _randomize(model, std, seed)
    return model.eval().requires_grad_(False)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The target's parameters in `dtype`, counted on the meta device (nothing is allocated)."""
    with torch.device("meta"), default_dtype(dtype):
        return param_bytes(CausalLM(cfg, 1))


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def random_drafter(cfg: DrafterConfig, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                   std: float = 0.02, seed: int = 1, heads: DSparkHeads | None = None) -> DraftModel:
    """A DFlash drafter (heads=None) or a DSpark one with random weights, sharing the target's embedding and
    LM head (bind it with Proposer / bind_target)."""
    with torch.device(device), default_dtype(dtype):
        model = DFlashDraft(cfg) if heads is None else DSparkDraft(cfg, heads)
    model.cast(device, dtype)
    _randomize(model, std, seed)
    return model.eval().requires_grad_(False)


def step_bytes(model: nn.Module, experts_read: float | None = None) -> int:
    """Weights read by one decode step: every parameter but the embedding table (one row is read); of a
    mixture-of-experts layer only the experts the step routes to, `experts_read` a layer (default: one
    row's top-k, a batch-1 plain step; a verify step reads the union of its rows' experts, measured by
    `bench.expert_union`)."""
    emb = model.embed_tokens.weight
    stacked = {id(p): m for m in model.modules() if isinstance(m, (Experts, Fp8Experts)) for p in m.parameters()}
    total = 0
    for p in model.parameters():
        if p is emb:
            continue
        nbytes = p.numel() * p.element_size()
        if id(p) in stacked:
            read = model.config.num_experts_per_tok if experts_read is None else experts_read
            nbytes = nbytes * min(read, p.shape[0]) / p.shape[0]
        total += nbytes
    return int(total) + (emb.numel() * emb.element_size() if model.config.tie_word_embeddings else 0)


def row_flops(model: CausalLM) -> tuple[float, float]:
    """FLOPs of one token row through `model`, as (its products, its attention per key of context):
    2 a multiply-add of every weight the row multiplies (the embedding is a lookup unless it is the
    tied head; of a mixture-of-experts layer the row's top-k experts), and QK plus PV over every head.
    Sliding windows are not counted: for such a model the attention term is an upper bound."""
    cfg = model.config
    emb = model.embed_tokens.weight
    stacked = {id(p) for m in model.modules() if isinstance(m, (Experts, Fp8Experts)) for p in m.parameters()}
    products = 0.0
    for p in model.parameters():
        if p.dim() < 2 or p is emb:
            continue
        share = min(cfg.num_experts_per_tok, p.shape[0]) / p.shape[0] if id(p) in stacked else 1.0
        products += 2 * p.numel() * share
    if cfg.tie_word_embeddings:
        products += 2 * emb.numel()
    return products, 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim


def draft_step_terms(drafter: nn.Module, target: CausalLM) -> dict[str, float]:
    """What a draft step must read and compute at the least, for its floor: the weights of its layers and
    fc, the LM head it multiplies (its own, or the target's it shares, streamed again), and FLOPs of 2 a
    multiply-add: every layer weight per block row (each request runs its whole block) less, per block row
    past those holding the verified drafts (`DraftModel.block_rows`), the last layer's weights after its
    qkv projection (`trimmed_gflops_per_row`); the fc per context row, the head per draft; attention per
    key and querying block row. DSpark's Markov and confidence heads are left out, so the floor stays a
    lower bound."""
    cfg = drafter.config
    matrices = [p for layer in drafter.layers for p in layer.parameters() if p.dim() >= 2]
    last = drafter.layers[-1]
    trimmed = [p for p in last.parameters() if p.dim() >= 2 and p is not last.self_attn.qkv_proj.weight]
    head = drafter.lm_head.weight if drafter.use_own_head else target.lm_head.weight
    fc = drafter.fc.weight
    return {"weight_bytes_gb": sum(p.numel() * p.element_size() for p in [*matrices, fc]) / 1e9,
            "head_bytes_gb": head.numel() * head.element_size() / 1e9,
            "block_rows": drafter.block_size,
            "draft_row_offset": 0 if drafter.anchor_first else 1,
            "layers": cfg.num_layers,
            "layer_gflops_per_row": 2 * sum(p.numel() for p in matrices) / 1e9,
            "trimmed_gflops_per_row": 2 * sum(p.numel() for p in trimmed) / 1e9,
            "fc_gflops_per_row": 2 * fc.numel() / 1e9,
            "head_gflops_per_row": 2 * head.numel() / 1e9,
            "attention_flops_per_key": 4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim}


def param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
