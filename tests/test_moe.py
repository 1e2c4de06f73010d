"""Mixture-of-experts targets (Qwen3-MoE, Qwen2-MoE) against transformers on tiny random checkpoints;
their config fields and load errors; tensor-parallel expert sharding on CPU ranks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from blockspec.config import ConfigError, ModelConfig
from blockspec.errors import ModelLoadError
from blockspec.models.kv_cache import causal_meta
from blockspec.models.loader import load_target
from blockspec.models.moe import SparseMoE, experts_reference, route
from factories import assert_incremental_matches_full, save_tiny

# (family, tied, stacked experts on disk, extra config): dense layers between sparse ones both ways
CASES = {
    "qwen3_moe-untied-renorm-mlp_only": ("qwen3_moe", False, False, {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3_moe-tied-stacked-step2": ("qwen3_moe", True, True, {"norm_topk_prob": False, "decoder_sparse_step": 2}),
    "qwen2_moe-untied-shared": ("qwen2_moe", False, False, {"norm_topk_prob": False, "mlp_only_layers": [2]}),
    "qwen2_moe-tied-stacked-renorm": ("qwen2_moe", True, True, {"norm_topk_prob": True, "mlp_only_layers": [0, 3]}),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family, tie, stacked, extra = CASES[request.param]
    path = save_tiny(tmp_path_factory.mktemp(family), family, seed=3, tie=tie, stacked_experts=stacked, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_target(path, dtype="float32", device="cpu", max_positions=512)
    return hf, ours, path


def test_layers_are_sparse_where_transformers_makes_them(pair):
    hf, ours, path = pair
    want = ["Sparse" in type(layer.mlp).__name__ for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == want
    assert any(want) and not all(want)  # both kinds in every case
    assert json.loads((path / "config.json").read_text())["model_type"] == ours.config.model_type


def forward(model, ids: torch.Tensor, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    cache = model.new_cache(2, 64)
    n = ids.shape[1]
    meta = causal_meta([1], [0], [n], n, cache.trash, "cpu", layer_types=model.config.layer_types)
    hidden, feats = model(ids, meta, cache, taps)
    return model.compute_logits(hidden), feats


def test_prefill_logits_and_taps_match_transformers(pair):
    hf, ours, _ = pair
    ids = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    taps = (-1, 0, 1, 2, 3)
    logits, feats = forward(ours, ids, taps)
    assert (logits - ref.logits).abs().max() < 1e-4
    expect = torch.cat([ref.hidden_states[t + 1] for t in taps], dim=-1)
    assert (feats - expect).abs().max() < 1e-4
    # negative control: the other renormalisation of the router's top-k moves the logits
    for layer in ours.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.renorm = not layer.mlp.renorm
    try:
        assert (forward(ours, ids, ())[0] - ref.logits).abs().max() > 1e-3
    finally:
        for layer in ours.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.renorm = not layer.mlp.renorm


def test_incremental_decode_matches_full_forward(pair):
    """The cache written in chunks of different sizes (1-row decode steps among them) gives one pass's logits."""
    _, ours, _ = pair
    assert_incremental_matches_full(ours, 14, (6, 1, 4, 1, 2))


def test_reference_experts_equal_every_expert_on_every_row():
    """The loop over selected experts against the dense oracle: all experts on all rows, then the
    router-weighted pick; and the router against softmax + top-k spelled out."""
    g = torch.Generator().manual_seed(0)
    rows, hidden, inter, experts, k = 9, 16, 12, 6, 3
    x = torch.randn(rows, hidden, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.3
    down = torch.randn(experts, hidden, inter, generator=g) * 0.3
    logits = torch.randn(rows, experts, generator=g)
    for renorm in (False, True):
        weights, ids = route(logits, k, renorm)
        probs = logits.softmax(-1)
        top = probs.sort(dim=-1, descending=True)
        want_w = top.values[:, :k] / (top.values[:, :k].sum(-1, keepdim=True) if renorm else 1)
        assert torch.equal(ids, top.indices[:, :k]) and torch.allclose(weights, want_w)
        every = torch.stack([F.linear(F.silu(x @ gate_up[e, :inter].T) * (x @ gate_up[e, inter:].T), down[e])
                             for e in range(experts)], dim=1)  # [rows, E, H]
        want = (every.gather(1, ids[..., None].expand(-1, -1, hidden)) * weights[..., None]).sum(1)
        assert torch.allclose(experts_reference(x, gate_up, down, weights, ids), want, atol=1e-5)
        assert not torch.allclose(experts_reference(x, gate_up, down, weights, ids.flip(1)), want, atol=1e-3)


def hf_dict(family: str, **extra) -> dict:
    """The config.json transformers writes for `family` (its defaults are the 30B-A3B / A2.7B shapes)."""
    return json.loads(transformers.AutoConfig.for_model(family, **extra).to_json_string())


def test_config_fields_and_their_errors():
    cfg = ModelConfig.from_hf(hf_dict("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2,
                                      norm_topk_prob=True), "x/config.json")
    assert cfg.moe_layers == (1, 3, 5) and cfg.num_experts == 128 and cfg.num_experts_per_tok == 8
    assert cfg.qk_norm and cfg.norm_topk_prob and cfg.moe_intermediate_size == 768
    assert cfg.shared_expert_intermediate_size == 0
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg  # blockspec writes what it reads
    hub = hf_dict("qwen3_moe", num_hidden_layers=2)  # hub configs: num_experts; transformers 5: num_local_experts
    hub["num_experts"] = hub.pop("num_local_experts")
    assert ModelConfig.from_hf(hub).num_experts == 128
    q2 = ModelConfig.from_hf(hf_dict("qwen2_moe", num_hidden_layers=2))
    assert q2.shared_expert_intermediate_size == 5632 and q2.qkv_bias and not q2.qk_norm
    assert ModelConfig.from_hf(q2.to_hf()) == q2
    bad = [({"num_local_experts": 0}, "num_local_experts"), ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
           ({"moe_intermediate_size": None}, "moe_intermediate_size"),
           ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
           ({"mlp_only_layers": [7]}, "mlp_only_layers"), ({"hidden_act": "gelu"}, "hidden_act")]
    for change, field in bad:
        with pytest.raises(ConfigError, match=rf"x/config.json: .*{field}"):
            ModelConfig.from_hf({**hf_dict("qwen3_moe", num_hidden_layers=4), **change}, "x/config.json")
    with pytest.raises(ConfigError, match=r"x/config.json: field 'shared_expert_intermediate_size'"):
        ModelConfig.from_hf(hf_dict("qwen2_moe", shared_expert_intermediate_size=0), "x/config.json")


def test_missing_expert_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_tiny(tmp_path / "m", "qwen3_moe", seed=1, layers=2)
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers.1.mlp.experts.5.gate_up_proj.weight.*needs all of"):
        load_target(path, device="cpu")
    del state["model.layers.1.mlp.experts.5.gate_proj.weight"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers.1.mlp.experts: checkpoint lacks experts \[5\] of gate_up_proj"):
        load_target(path, device="cpu")


# ---------------------------------------------------------------------------------------- tensor parallel
def _tp_rank(rank: int, init_file: str, paths: list[str], out: str) -> None:
    """Shard each checkpoint over 2 gloo ranks, run one prefill and one decode step, save the logits."""
    import os

    import torch.distributed as dist

    from blockspec.parallel import shard_model  # before init_process_group: see blockspec/parallel/tp.py

    torch.set_num_threads(1)
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for i, path in enumerate(paths):
            model, _ = load_target(path, "float32", "cpu", max_positions=512)
            shard_model(model, rank, 2)
            torch.save(run_steps(model), Path(out) / f"{i}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_steps(model) -> torch.Tensor:
    ids = torch.arange(3, 20).view(1, -1) * 5 % 96
    cache = model.new_cache(2, 64)
    meta = causal_meta([0], [0], [16], 16, cache.trash, "cpu", layer_types=model.config.layer_types)
    first = model.compute_logits(model(ids[:, :16], meta, cache)[0])
    meta = causal_meta([0], [16], [1], 1, cache.trash, "cpu", layer_types=model.config.layer_types)
    return torch.cat([first, model.compute_logits(model(ids[:, 16:], meta, cache)[0])], dim=1)


def test_tp2_expert_shards_give_the_single_process_logits(tmp_path, monkeypatch):
    """Every rank holds every expert with half its width (and half the shared expert's); the router is
    replicated, so both ranks route alike and one all_reduce per block sums the halves."""
    import torch.multiprocessing as mp

    from blockspec.parallel import shard_model
    from blockspec.parallel.tp import check_shardable

    paths = [save_tiny(tmp_path / f, f, seed=2, layers=3, mlp_only_layers=[1], vocab=96, hidden=32)
             for f in ("qwen3_moe", "qwen2_moe")]
    want = [run_steps(load_target(p, "float32", "cpu", max_positions=512)[0]) for p in paths]
    mp.spawn(_tp_rank, args=(str(tmp_path / "init"), [str(p) for p in paths], str(tmp_path)), nprocs=2)
    for i, ref in enumerate(want):
        for rank in (0, 1):
            got = torch.load(tmp_path / f"{i}-{rank}.pt")
            assert (got - ref).abs().max() < 1e-4
    model, _ = load_target(paths[1], "float32", "cpu")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        with pytest.raises(ConfigError, match=name):
            check_shardable(dataclasses.replace(model.config, **{name: 25}), 2)
    model.config = dataclasses.replace(model.config, moe_intermediate_size=25)
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        shard_model(model, 0, 2)
    assert model.layers[0].mlp.experts.down_proj.shape == (8, 32, 24)  # nothing was changed before the check


# ---------------------------------------------------------------------------------------- bench shapes
def test_qwen3_30b_a3b_shape_and_the_weights_a_step_reads():
    """30.5B parameters, 3.0B read by a batch-1 plain step (the top-8 of 128 experts, no embedding
    table); a step that reads every expert reads them all; the drafter has z-lab's 0.47B."""
    from blockspec.bench.arch import get_arch, param_bytes, step_bytes
    from blockspec.drafters import DFlashDraft
    from blockspec.models.llama import CausalLM

    arch = get_arch("qwen3-30b-a3b")
    with torch.device("meta"):
        model = CausalLM(arch.target, 256)
        drafter = DFlashDraft(arch.dflash)
    assert abs(param_bytes(model) / 4 - 30.53e9) < 0.01e9
    embed = model.embed_tokens.weight.numel() * 4
    assert abs(step_bytes(model) / 4 - 3.04e9) < 0.01e9
    assert step_bytes(model, experts_read=128) == param_bytes(model) - embed
    assert abs(sum(p.numel() for p in drafter.parameters()) - 0.474e9) < 0.001e9
    assert arch.dflash.target_layer_ids == (1, 12, 23, 34, 45) and arch.dflash.block_size == 16


def test_the_dense_baseline_reads_what_a_plain_moe_step_reads():
    """qwen3-30b-a3b-dense, the MoE's batch baseline: no experts, an MLP as wide as the 8 routed experts,
    so a decode step reads the MoE plain step's bytes (its router aside, 0.4 %)."""
    from blockspec.bench.arch import get_arch, step_bytes
    from blockspec.models.llama import CausalLM

    with torch.device("meta"):
        moe, dense = (CausalLM(get_arch(a).target, 256) for a in ("qwen3-30b-a3b", "qwen3-30b-a3b-dense"))
    assert not dense.config.is_moe and dense.config.intermediate_size == 8 * 768
    assert 0.99 < step_bytes(dense) / step_bytes(moe) < 1.0


def test_expert_union_grows_with_rows_and_shrinks_with_locality():
    from blockspec.bench.arch import get_arch, random_target
    from blockspec.bench.expert_union import measure

    arch = get_arch("tiny-moe")
    model = random_target(arch.target, 256, "cpu", torch.float32, arch.init_std)
    result = measure(model, requests=(1, 4), rows=(1, 8), length=32, samples=8)
    union = {(p["routing"], p["requests"], p["rows"]): p for p in result["points"]}
    k, experts = arch.target.num_experts_per_tok, arch.target.num_experts
    for routing in ("own", "uniform", "local"):
        assert union[routing, 1, 1]["union_mean"] == k and union[routing, 1, 1]["vs_plain"] == 1.0
        assert union[routing, 1, 8]["union_mean"] > k and union[routing, 4, 8]["union_mean"] <= experts
        assert union[routing, 4, 8]["union_mean"] >= union[routing, 1, 8]["union_mean"]
        assert union[routing, 1, 1]["union_mean"] == union["own", 1, 1]["union_mean"]  # one row: nothing to model
    # uniform: independent rows, so the union and the kept share are those of independent top-k draws
    uniform = union["uniform", 1, 8]
    assert abs(uniform["union_mean"] - uniform["uniform_expectation"]) < 0.1 * uniform["uniform_expectation"]
    assert abs(uniform["adjacent_rows_share"] - k / experts) < 0.1
    assert union["local", 1, 8]["union_mean"] < uniform["union_mean"]
    assert union["local", 1, 8]["adjacent_rows_share"] > uniform["adjacent_rows_share"] + 0.1
    assert all(b.routing is None for b in model.modules() if hasattr(b, "routing"))
    assert union["uniform", 1, 8]["step_gb"] > union["uniform", 1, 1]["step_gb"]
