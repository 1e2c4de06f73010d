"""FP8 weights on the CPU: FP8 checkpoints (block, per-channel and per-tensor scales, layers kept in
bf16) equal to their dequantized reference, fused q/k/v and gate/up scales that stay aligned,
refused quantization methods, `quantization="fp8"` at load, a checkpoint's FP8 KV cache scales, and
speculative decoding exact on the quantized target (greedy against its own plain decoding, seeded
sampling likewise)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError, EngineArgs
from blockspec.errors import ModelLoadError
from blockspec.kernels import fp8
from blockspec.models.kv_cache import causal_meta
from blockspec.models.loader import load_target
from blockspec.models.quant import Fp8Checkpoint, Fp8Experts, Fp8Linear, Fp8Weight, concat_fp8, is_quantized
from factories import save_drafter_target, save_moe_target
from test_spec import FIXTURES, add_oracle, prompts, run

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The drafter fixtures' tiny qwen3 target (q 32 rows, k and v 16, gate and up 72: not all whole
    32-row blocks), in fp32."""
    return save_drafter_target(tmp_path_factory.mktemp("target"))


def write_fp8(src: Path, dst: Path, layout: str, keep: tuple[str, ...] = (), scale_name: str | None = None,
              ignore: list[str] | None = None) -> Path:
    """`src` as an FP8 checkpoint: every decoder linear (but those whose name holds one of `keep`) in
    e4m3 with `layout` scales ("block32", "block16": weight_scale_inv over those blocks; "channel",
    "tensor": weight_scale), and beside it the same checkpoint with the dequantized weights in fp32.
    With `ignore` (its `ignore` list), in compressed-tensors' float-quantized format instead, as
    llm-compressor writes it: weight_scale for every layout, [N, 1] per channel, "group16" scales over
    16 columns of K."""
    state = load_file(str(src / "model.safetensors"))
    quant, plain = {}, {}
    for name, t in state.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS) or any(k in name for k in keep):
            quant[name] = plain[name] = t
            continue
        if layout.startswith("block"):
            b = int(layout[5:])
            q, s = fp8.quantize_blocks(t, (b, b))
            block = (b, b)
        elif layout.startswith("group"):
            block = (1, int(layout[5:]))
            q, s = fp8.quantize_blocks(t, block)
        elif layout == "channel":
            q, s = fp8.quantize_per_channel(t)
            block = (1, t.shape[1])
        else:  # one scale for the whole tensor
            s = (t.abs().max() / fp8.E4M3_MAX).reshape(1)
            q = (t / s).to(fp8.FP8)
            block = (t.shape[0], t.shape[1])
        quant[name] = q
        hf_name = ".weight_scale_inv" if layout.startswith("block") else ".weight_scale"
        quant[module + (scale_name or (".weight_scale" if ignore is not None else hf_name))] = (
            s if layout == "tensor" or ignore is not None else s.squeeze(1) if layout == "channel" else s)
        plain[name] = fp8.dequantize_reference(q, s.reshape(1, 1) if layout == "tensor" else s, block, torch.float32)
    config = json.loads((src / "config.json").read_text())
    for out, tensors, qc in ((dst / "fp8", quant, True), (dst / "dequantized", plain, False)):
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors"))
        cfg = dict(config, torch_dtype="float32")
        if qc and ignore is not None:
            strategy = "".join(c for c in layout if c.isalpha())
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                       "group_size": block[1] if strategy == "group" else None,
                       **({"block_structure": list(block)} if strategy == "block" else {})}
            activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
            cfg["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                              "input_activations": activations, "format": None}},
                "ignore": ignore, "kv_cache_scheme": None}
        elif qc:
            cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                          **({"weight_block_size": [b, b]} if layout.startswith("block") else {}),
                                          **({"modules_to_not_convert": list(keep)} if keep else {})}
        (out / "config.json").write_text(json.dumps(cfg))
    return dst


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    meta = causal_meta([0], [0], [ids.shape[1]], ids.shape[1], cache.trash, "cpu")
    return model.compute_logits(model(ids, meta, cache)[0])


IDS = torch.randint(2, 95, (1, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout, blocks", [("block32", {"qkv_proj": (1, 32), "gate_up_proj": (1, 32),
                                                         "o_proj": (32, 32), "down_proj": (32, 32)}),
                                            ("block16", {"qkv_proj": (16, 16), "gate_up_proj": (1, 16)}),
                                            ("channel", {"qkv_proj": (1, 32), "down_proj": (1, 72)}),
                                            ("tensor", {"qkv_proj": (1, 32), "o_proj": (1, 32)})])
def test_fp8_checkpoint_equals_its_dequantized_reference(target, tmp_path, layout, blocks):
    """Logits within fp32 rounding of the same weights dequantized; the fused parts' scales stay on
    their rows (32-row blocks do not fit k's 16 rows or gate's 72: those spread to one row each)."""
    dirs = write_fp8(target, tmp_path, layout)
    ours, _ = load_target(dirs / "fp8", "float32", "cpu", 128)
    ref, _ = load_target(dirs / "dequantized", "float32", "cpu", 128)
    layer = ours.layers[1]
    for name, block in blocks.items():
        module = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
        assert isinstance(module, Fp8Linear) and module.weight.dtype == torch.float8_e4m3fn
        assert module.block == block, name
    assert type(ours.lm_head) is nn.Linear and ours.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5


def test_layers_a_checkpoint_keeps_unquantized_load_as_they_are(target, tmp_path):
    dirs = write_fp8(target, tmp_path, "block16", keep=("layers.0.mlp", "layers.3.self_attn"))
    ours, _ = load_target(dirs / "fp8", "float32", "cpu", 128)
    ref, _ = load_target(dirs / "dequantized", "float32", "cpu", 128)
    assert type(ours.layers[0].mlp.gate_up_proj) is nn.Linear and type(ours.layers[3].self_attn.qkv_proj) is nn.Linear
    assert isinstance(ours.layers[0].self_attn.qkv_proj, Fp8Linear)
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5


def test_modules_to_not_convert_names_modules_up_to_a_boundary_as_transformers_reads_it():
    """An entry keeps the modules it names from the start up to a module boundary, or by the name's end:
    "model.layers.1" keeps layer 1, not layer 10 (a plain substring refused layer 10's FP8 weights), and
    "mlp.gate" keeps the router, not mlp.gate_proj."""
    fmt = Fp8Checkpoint((128, 128), ("lm_head", "model.layers.1", "mlp.gate", "model.layers.2.*.k_proj"), "cfg")
    assert fmt.keeps("model.layers.1.mlp.down_proj") == "model.layers.1"
    assert fmt.keeps("model.layers.10.mlp.down_proj") is None
    assert fmt.keeps("model.layers.3.mlp.gate") == "mlp.gate" and fmt.keeps("model.layers.3.mlp.gate_proj") is None
    assert fmt.keeps("lm_head") == "lm_head" and fmt.keeps("model.layers.2.self_attn.k_proj") is not None
    assert Fp8Checkpoint(None, ("lm_head[",), "cfg").keeps("lm_head[") == "lm_head["  # not a pattern: itself


def test_llm_compressors_older_naive_quantized_format_is_the_float_quantized_layout(target, tmp_path):
    """Older llm-compressor FP8 checkpoints say "naive-quantized" for the float-quantized layout: they load,
    equal to their dequantized reference."""
    dirs = write_fp8(target, tmp_path, "tensor", ignore=["lm_head"])
    cfg = json.loads((dirs / "fp8" / "config.json").read_text())
    cfg["quantization_config"]["format"] = "naive-quantized"
    (dirs / "fp8" / "config.json").write_text(json.dumps(cfg))
    ours, _ = load_target(dirs / "fp8", "float32", "cpu", 128)
    ref, _ = load_target(dirs / "dequantized", "float32", "cpu", 128)
    assert isinstance(ours.layers[0].self_attn.qkv_proj, Fp8Linear)
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5


def test_concatenated_scales_stay_on_their_rows():
    """q/k/v of 48, 16 and 40 rows in 32-row blocks: the fused weight dequantizes to the parts'
    dequantized weights stacked; stacking the block scales as they are (negative control) does not."""
    g = torch.Generator().manual_seed(0)
    parts = []
    for rows in (48, 16, 40):
        q, s = fp8.quantize_blocks(torch.randn(rows, 80, generator=g) * torch.rand(rows, 1, generator=g), (32, 32))
        parts.append(Fp8Weight(q, s, (32, 32)))
    want = torch.cat([fp8.dequantize_reference(p.weight, p.scale, p.block, torch.float32) for p in parts])
    fused = concat_fp8(parts)
    assert fused.block == (1, 32) and fused.scale.shape == (104, 3)
    assert torch.equal(fp8.dequantize_reference(fused.weight, fused.scale, fused.block, torch.float32), want)
    naive = torch.cat([p.scale for p in parts])
    assert not torch.equal(fp8.dequantize_reference(fused.weight, naive[:4], (32, 32), torch.float32), want)
    # whole blocks (a ragged last part) stack as they are
    q, s = fp8.quantize_blocks(torch.randn(64, 80, generator=g), (32, 32))
    aligned = concat_fp8([Fp8Weight(q, s, (32, 32)), parts[1]])
    assert aligned.block == (32, 32) and aligned.scale.shape == (3, 3)
    assert torch.equal(fp8.dequantize_reference(aligned.weight, aligned.scale, aligned.block, torch.float32),
                       torch.cat([fp8.dequantize_reference(q, s, (32, 32), torch.float32), want[48:64]]))
    # a per-channel part among block parts: both spread to one scale a row and a common column block
    q, s = fp8.quantize_per_channel(torch.randn(24, 80, generator=g))
    mixed = concat_fp8([parts[1], Fp8Weight(q, s, (1, 80))])
    assert mixed.block == (1, math.gcd(32, 80))
    want = torch.cat([fp8.dequantize_reference(parts[1].weight, parts[1].scale, (32, 32), torch.float32),
                      fp8.dequantize_reference(q, s, (1, 80), torch.float32)])
    assert torch.equal(fp8.dequantize_reference(mixed.weight, mixed.scale, mixed.block, torch.float32), want)


@pytest.mark.parametrize("layout", ["block32", "channel", "tensor", "group16"])
def test_a_compressed_tensors_fp8_checkpoint_equals_its_dequantized_reference(target, tmp_path, layout):
    """llm-compressor's float-quantized format (FP8_BLOCK, FP8_DYNAMIC, FP8, and K groups): the same weights
    and scales as the fine-grained format under other names and shapes. `ignore` keeps modules unquantized by
    whole name (a name is not a prefix: mlp.gate does not keep mlp.gate_proj) or by "re:" pattern."""
    keep = ("layers.0.mlp.down_proj", "layers.3.self_attn.")
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate", r"re:model\.layers\.3\.self_attn\."]
    dirs = write_fp8(target, tmp_path, layout, keep=keep, ignore=ignore)
    ours, _ = load_target(dirs / "fp8", "float32", "cpu", 128)
    ref, _ = load_target(dirs / "dequantized", "float32", "cpu", 128)
    assert isinstance(ours.layers[1].mlp.gate_up_proj, Fp8Linear) and isinstance(ours.layers[0].mlp.gate_up_proj,
                                                                                   Fp8Linear)
    assert type(ours.layers[0].mlp.down_proj) is nn.Linear and type(ours.layers[3].self_attn.qkv_proj) is nn.Linear
    block = {"block32": (1, 32), "channel": (1, 32), "tensor": (1, 32), "group16": (1, 16)}[layout]
    assert ours.layers[2].self_attn.qkv_proj.block == block  # k's 16 rows do not fit 32-row blocks: one row each
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5


@pytest.mark.parametrize("fault, error", [
    ("packed", r"config_groups.group_0 is stored 'pack-quantized'; supported: compressed-tensors' float-quantized"),
    ("int", r"config_groups.group_0.weights are 8-bit int; supported: 8-bit float"),
    ("fp4", r"config_groups.group_0.weights are 4-bit float; supported: 8-bit float"),
    ("asymmetric", r"config_groups.group_0.weights.symmetric is false; FP8 weights with zero points"),
    ("attn_head", r"weights.strategy 'attn_head' is not supported; supported: tensor, channel, block, group"),
    ("block", r"weights.block_structure must be positive integers \(\[rows, columns\] for a block\), got \[128\]"),
    ("two blocks", r"declare weight scales over different blocks \[\(32, 32\), \(64, 64\)\]"),
    ("no groups", r"quantization_config.config_groups must be an object of quantization schemes"),
    ("ignored", r"layers.0.self_attn.\w_proj.weight is FP8 but quantization_config.ignore lists 're:.*layers.0.self")])
def test_a_broken_compressed_tensors_checkpoint_names_the_field(target, tmp_path, fault, error):
    path = write_fp8(target, tmp_path, "block32", ignore=["lm_head"]) / "fp8"
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg["quantization_config"]
    w = qc["config_groups"]["group_0"]["weights"]
    if fault == "packed":
        qc["format"] = "pack-quantized"
    elif fault in ("int", "fp4"):
        w.update({"type": "int"} if fault == "int" else {"num_bits": 4})
    elif fault == "asymmetric":
        w["symmetric"] = False
    elif fault == "attn_head":
        w["strategy"] = "attn_head"
    elif fault == "block":
        w["block_structure"] = [128]
    elif fault == "two blocks":
        qc["config_groups"]["group_1"] = dict(qc["config_groups"]["group_0"], weights=dict(w, block_structure=[64, 64]))
    elif fault == "no groups":
        del qc["config_groups"]
    else:
        qc["ignore"] = ["re:.*layers.0.self"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ConfigError, ModelLoadError), match=error):
        load_target(path, "float32", "cpu", 128)


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory) -> Path:
    return save_moe_target(tmp_path_factory.mktemp("moe"))


@pytest.mark.parametrize("layout", ["block16", "channel", "compressed-tensors"])
def test_an_fp8_mixture_of_experts_checkpoint_keeps_its_experts_in_e4m3(moe_target, tmp_path, layout):
    """Experts stored one by one in e4m3 (as Qwen/Qwen3-30B-A3B-FP8 ships them, and llm-compressor's FP8 MoE
    checkpoints with their routers ignored by pattern) stack into e4m3 `Fp8Experts` with their scales
    (gate/up parts not on a block boundary spread to one row each), equal to the same weights dequantized;
    the dense middle layer's MLP is an Fp8Linear; speculation is exact on it."""
    ct = layout == "compressed-tensors"
    dirs = write_fp8(moe_target, tmp_path, "channel" if ct else layout,
                     ignore=["lm_head", "re:.*mlp.gate$"] if ct else None)
    ours, _ = load_target(dirs / "fp8", "float32", "cpu", 128)
    ref, _ = load_target(dirs / "dequantized", "float32", "cpu", 128)
    experts = ours.layers[0].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == experts.down_proj.dtype == fp8.FP8
    assert experts.gate_up_proj.shape[0] == 8 and isinstance(ours.layers[2].mlp.gate_up_proj, Fp8Linear)
    assert (experts.gate_up_block, experts.down_block) == ({"block16": ((1, 16), (16, 16)),
                                                            "channel": ((1, 32), (1, 24)),
                                                            "compressed-tensors": ((1, 32), (1, 24))}[layout])
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5
    assert ours.to(torch.bfloat16).layers[0].mlp.experts.gate_up_proj.dtype == fp8.FP8  # a cast keeps e4m3

    ps = prompts(3, seed=6)
    plain = LLM(str(dirs / "fp8"), device="cpu", max_model_len=160)
    expected = run(plain, ps, GREEDY)
    llm = LLM(str(dirs / "fp8"), device="cpu", max_model_len=160, speculative_config={
        "method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False})
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected


def test_quantization_fp8_quantizes_a_mixture_of_experts_experts(moe_target):
    """quantization="fp8" on an MoE target: the experts per output channel of each expert, beside the
    attention and dense MLP products; routers stay in the model dtype; greedy speculation equals the
    quantized model's own plain decoding, which differs from the unquantized one's."""
    plain = LLM(str(moe_target), device="cpu", max_model_len=160, quantization="fp8")
    model = plain.engine.model
    assert all(isinstance(layer.mlp.experts, Fp8Experts) for i, layer in enumerate(model.layers) if i != 2)
    assert model.layers[0].mlp.gate.weight.dtype == torch.float32 and model.layers[0].mlp.experts.down_block == (1, 24)
    ps = prompts(3, seed=7)
    expected = run(plain, ps, GREEDY)
    assert run(LLM(str(moe_target), device="cpu", max_model_len=160), ps, GREEDY) != expected
    llm = LLM(str(moe_target), device="cpu", max_model_len=160, quantization="fp8", speculative_config={
        "method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False})
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected


def test_an_mixture_of_experts_layer_with_some_experts_in_fp8_is_refused(moe_target, tmp_path):
    path = write_fp8(moe_target, tmp_path, "channel", keep=("layers.1.mlp.experts.3.",)) / "fp8"
    with pytest.raises(ModelLoadError, match=r"layers.1.mlp.experts: the checkpoint's FP8 gate_up_proj lacks "
                                             r"experts \[3\] of 8 \(an MoE layer's experts are all FP8 or none\)"):
        load_target(path, "float32", "cpu", 128)


def modelopt(target: Path, tmp_path: Path, where: str, qc: dict | None = None) -> tuple[Path, Path]:
    """`target` as NVIDIA ModelOpt writes an FP8 checkpoint: per-tensor `weight_scale`s, a static `input_scale`
    for each FP8 product, ModelOpt-named KV cache scales (0.5, 0.25), layer 3's MLP excluded, its
    quantization in hf_quant_config.json (or in config.json's quantization_config); and the dequantized twin."""
    dirs = write_fp8(target, tmp_path, "tensor", keep=("layers.3.mlp.",))
    path = dirs / "fp8"
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    qc = qc or {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                "exclude_modules": ["lm_head", "model.layers.3.mlp*"]}
    if where == "config.json":
        cfg["quantization_config"] = {"quant_method": "modelopt", **qc}
    else:
        (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": qc}))
    (path / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(path / "model.safetensors"))
    for name in [n for n, t in state.items() if t.dtype == fp8.FP8]:
        state[name.removesuffix(".weight") + ".input_scale"] = torch.tensor([0.02])
    for i in range(5):
        state[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5)
        state[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    save_file(state, str(path / "model.safetensors"))
    return path, dirs / "dequantized"


@pytest.mark.parametrize("where", ["hf_quant_config.json", "config.json"])
def test_a_modelopt_fp8_checkpoint_equals_its_dequantized_reference(target, tmp_path, where):
    """Per-tensor scales of each of q, k, v stay on their rows of the fused product; the static input
    scales are not used (weight-only FP8); `exclude_modules` wildcards keep layer 3's MLP in fp32; the
    KV cache scales are the ModelOpt-named ones; `blockspec quantize` refuses it as quantized already."""
    path, ref_dir = modelopt(target, tmp_path, where)
    ours, _ = load_target(path, "float32", "cpu", 128)
    ref, _ = load_target(ref_dir, "float32", "cpu", 128)
    qkv = ours.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.block == (1, 32)
    assert type(ours.layers[3].mlp.gate_up_proj) is nn.Linear and isinstance(ours.layers[2].mlp.down_proj, Fp8Linear)
    assert ours.kv_scales.k == (0.5,) * 5 and ours.kv_scales.v == (0.25,) * 5
    with torch.no_grad():
        assert (logits(ours, IDS) - logits(ref, IDS)).abs().max() < 1e-5
    from blockspec.models.fp8_export import write_fp8_checkpoint

    with pytest.raises(ConfigError, match=rf"{where}: the checkpoint is quantized already \(quant_method 'modelopt'\)"):
        write_fp8_checkpoint(path, tmp_path / "again")


@pytest.mark.parametrize("qc, error", [
    ({"quant_algo": "NVFP4"}, r"hf_quant_config.json: quantization_config.quant_algo 'NVFP4' is not supported; "
                              r"supported: FP8"),
    ({"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}, r"kv_cache_quant_algo 'INT8' is not supported"),
    ({"quant_algo": "FP8", "exclude_modules": ["*layers.0.self_attn*"]},
     r"layers.0.self_attn.\w_proj.weight is FP8 but quantization_config.exclude_modules lists "
     r"'\*layers.0.self_attn\*'"),
])
def test_a_broken_modelopt_checkpoint_names_the_field(target, tmp_path, qc, error):
    path, _ = modelopt(target, tmp_path, "hf_quant_config.json", qc)
    with pytest.raises((ConfigError, ModelLoadError), match=error):
        load_target(path, "float32", "cpu", 128)


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "quark", None])
def test_other_quantization_methods_are_refused_naming_the_field(target, tmp_path, method):
    cfg = json.loads((target / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(target / "model.safetensors")
    with pytest.raises(ConfigError, match=rf"config.json: quantization_config.quant_method {method!r} is not "
                                          r"supported; supported: fp8, fbgemm_fp8, compressed-tensors, modelopt"):
        load_target(tmp_path, "float32", "cpu", 128)


@pytest.mark.parametrize("fault, error", [
    ("e5m2", r"quantization_config.fmt 'e5m2' is not supported; supported: e4m3"),
    ("no scale", r"layers.0.self_attn.q_proj.weight is FP8 but the checkpoint has neither"),
    ("bad scale", r"layers.0.self_attn.q_proj.weight_scale_inv has shape \(3, 3\), which fits weight \(32, 32\)"),
    ("not converted", r"layers.0.self_attn.\w_proj.weight is FP8 but quantization_config.modules_to_not_convert "
                      r"lists .model.layers.0.self_attn."),
    ("nan scale", r"layers.0.self_attn.q_proj.weight_scale_inv holds values that are not finite"),
    ("no config", r"model.layers.\d+.\S+.weight is torch.float8_e4m3fn, but config.json has no quantization_config"),
])
def test_a_broken_fp8_checkpoint_names_the_tensor_or_field(target, tmp_path, fault, error):
    dirs = write_fp8(target, tmp_path, "block16")
    path = dirs / "fp8"
    cfg = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    if fault == "e5m2":
        cfg["quantization_config"]["fmt"] = "e5m2"
    elif fault == "no scale":
        del state[name]
    elif fault == "bad scale":
        state[name] = torch.ones(3, 3)
    elif fault == "nan scale":
        state[name][0, 0] = float("nan")
    elif fault == "no config":
        del cfg["quantization_config"]
    else:
        cfg["quantization_config"]["modules_to_not_convert"] = ["model.layers.0.self_attn"]
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises((ConfigError, ModelLoadError), match=error):
        load_target(path, "float32", "cpu", 128)


def test_quantization_fp8_quantizes_the_decoder_products_per_channel(target):
    model, _ = load_target(target, "float32", "cpu", 128, quantization="fp8")
    ref, _ = load_target(target, "float32", "cpu", 128)
    quantized = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(quantized) == 4 * model.config.num_hidden_layers
    assert all(m.block == (1, m.in_features) and m.weight_scale.shape == (m.out_features, 1) for m in quantized)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    # the same model as the dequantized weights in fp32, and not the unquantized one
    for layer, base in zip(model.layers, ref.layers):
        for name in ("qkv_proj", "o_proj"):
            m = getattr(layer.self_attn, name)
            getattr(base.self_attn, name).weight.data = fp8.dequantize_reference(m.weight, m.weight_scale, m.block,
                                                                                 torch.float32)
        for name in ("gate_up_proj", "down_proj"):
            m = getattr(layer.mlp, name)
            getattr(base.mlp, name).weight.data = fp8.dequantize_reference(m.weight, m.weight_scale, m.block,
                                                                           torch.float32)
    unquantized, _ = load_target(target, "float32", "cpu", 128)
    with torch.no_grad():
        got = logits(model, IDS)
        assert (got - logits(ref, IDS)).abs().max() < 1e-5
        assert (got - logits(unquantized, IDS)).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="quantization 'int4' is not supported; supported: fp8"):
        EngineArgs(quantization="int4")


def test_a_dtype_cast_keeps_fp8_weights_and_scales(target):
    model, _ = load_target(target, "float32", "cpu", 128, quantization="fp8")
    model.to(torch.float16)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight_scale.dtype == torch.float32
    assert model.embed_tokens.weight.dtype == torch.float16


@pytest.mark.parametrize("fp8", ["quantization", "block4", "tensor"])
def test_tensor_parallel_shards_fp8_weights_with_their_scales(target, tmp_path, fp8):
    """2 gloo ranks over FP8 weights give the single process's tokens, greedy and with DFlash: per-channel
    scales (`quantization="fp8"`) and a per-tensor checkpoint's split with any slice, 4 x 4 blocks along
    their boundaries."""
    path = target if fp8 == "quantization" else write_fp8(target, tmp_path, fp8) / "fp8"
    kw = {"quantization": "fp8"} if fp8 == "quantization" else {}
    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    ps = prompts(3, seed=8)
    want = run(LLM(str(path), device="cpu", max_model_len=160, seed=0, speculative_config=spec, **kw), ps, GREEDY)
    with LLM(str(path), device="cpu", max_model_len=160, seed=0, tensor_parallel_size=2, speculative_config=spec,
             **kw) as tp:
        assert run(tp, ps, GREEDY) == want


@pytest.mark.parametrize("fp8", ["quantization", "block4"])
def test_tensor_parallel_shards_fp8_experts_with_their_scales(moe_target, tmp_path, fp8):
    """A mixture's e4m3 experts (per channel on the fly; a checkpoint's 4 x 4 blocks) split by expert width
    over 2 gloo ranks: the single process's greedy tokens."""
    path = moe_target if fp8 == "quantization" else write_fp8(moe_target, tmp_path, fp8) / "fp8"
    kw = {"quantization": "fp8"} if fp8 == "quantization" else {}
    ps = prompts(3, seed=9)
    want = run(LLM(str(path), device="cpu", max_model_len=160, seed=0, **kw), ps, GREEDY)
    with LLM(str(path), device="cpu", max_model_len=160, seed=0, tensor_parallel_size=2, **kw) as tp:
        assert run(tp, ps, GREEDY) == want


def test_a_ranks_slices_of_an_fp8_weight_dequantize_to_its_slices():
    """Row slices on and off the scale blocks' boundaries (those spread each row its scale), their stacking,
    and column slices along the blocks: each dequantizes to the same slice of the whole weight."""
    from blockspec.parallel.tp import _fp8_cat, _fp8_cols, _fp8_rows

    for shape in ((48, 64), (3, 48, 64)):  # a linear's weight, stacked experts
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        parts = [fp8.quantize_blocks(m, (16, 16)) for m in w.reshape(-1, 48, 64)]
        q, sc = torch.stack([p[0] for p in parts]).reshape(shape), torch.stack([p[1] for p in parts])
        sc = sc.reshape(*shape[:-2], *sc.shape[-2:])
        whole = Fp8Weight(q, sc, (16, 16))

        def dequant(x: Fp8Weight) -> torch.Tensor:
            flat_w, flat_s = x.weight.reshape(-1, *x.weight.shape[-2:]), x.scale.reshape(-1, *x.scale.shape[-2:])
            return torch.stack([fp8.dequantize_reference(a, b, x.block, torch.float32) for a, b in zip(flat_w, flat_s)])

        full = dequant(whole)
        for lo, hi in ((0, 16), (8, 24), (40, 48), (5, 6)):
            assert torch.equal(dequant(_fp8_rows(whole, lo, hi)), full[:, lo:hi])
        stacked = _fp8_cat([_fp8_rows(whole, 0, 8), _fp8_rows(whole, 16, 40)])
        assert torch.equal(dequant(stacked), torch.cat([full[:, 0:8], full[:, 16:40]], dim=1))
        assert torch.equal(dequant(_fp8_cols(whole, 16, 48, "x")), full[..., 16:48])
        with pytest.raises(ConfigError, match="x: tensor parallelism splits its 64 input columns at 8 and 40"):
            _fp8_cols(whole, 8, 40, "x")


def test_tensor_parallel_names_fp8_scale_blocks_a_rank_would_cut(target, tmp_path):
    """down_proj's 72 input columns split 36 a rank, inside 16-column scale blocks: refused by name before
    any weight is sharded."""
    from blockspec.parallel import shard_model

    model, _ = load_target(write_fp8(target, tmp_path, "block16") / "fp8", "float32", "cpu", 128)
    with pytest.raises(ConfigError, match=r"down_proj: tensor parallelism splits its 72 input columns at 0 and 36, "
                                          r"inside its FP8 scale blocks of 16 columns"):
        shard_model(model, 0, 2)
    assert model.layers[0].self_attn.heads == 4 and isinstance(model.layers[0].self_attn.o_proj, Fp8Linear)


def test_cli_passes_quantization_and_kv_cache_dtype(monkeypatch):
    import argparse

    from blockspec import cli_options

    p = argparse.ArgumentParser()
    cli_options.add_model_args(p)
    cli_options.add_sampling_args(p)
    args = p.parse_args(["x", "--quantization", "fp8", "--kv-cache-dtype", "fp8"])
    seen = {}
    monkeypatch.setattr(cli_options, "LLM", lambda model, **kw: seen.update(kw))
    if hasattr(cli_options, "settle_model"):
        cli_options.settle_model(args)
    cli_options.build_llm(args)
    assert seen["quantization"] == seen["kv_cache_dtype"] == "fp8"


# ---------------------------------------------------------------- speculation on the quantized target
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def unquantized(target) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=160)


@pytest.mark.parametrize("method, fixture, fp8", [("dflash", "dflash", {"quantization": "fp8"}),
                                                  ("dspark", "dspark_vanilla", {"quantization": "fp8"}),
                                                  ("dflash", "dflash", {"kv_cache_dtype": "fp8"}),
                                                  ("dspark", "dspark_vanilla", {"quantization": "fp8",
                                                                                "kv_cache_dtype": "fp8"})])
def test_speculation_on_the_quantized_target_is_exact(target, unquantized, method, fixture, fp8):
    """FP8 weights, an FP8 KV cache (the target's and the drafter's), or both. Greedy: the quantized
    model's own plain decoding, token for token (oracle drafts, so blocks are accepted and rejected);
    seeded sampling: the same tokens as plain sampling."""
    ps = prompts(4, seed=3)
    plain = LLM(str(target), device="cpu", max_model_len=160, **fp8)
    expected = run(plain, ps, GREEDY)
    assert run(unquantized, ps, GREEDY) != expected  # the test tells the quantized target from the original
    llm = LLM(str(target), device="cpu", max_model_len=160, speculative_config={
        "method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False}, **fp8)
    if "kv_cache_dtype" in fp8:
        assert llm.engine.runner.cache.k[0].dtype == llm.engine.context.cache.v[0].dtype == torch.float8_e4m3fn
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected
    assert llm.get_stats()["mean_acceptance_length"] > 2.0
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, ignore_eos=True)
    assert run(llm, ps, sampled) == run(plain, ps, sampled)


def test_an_fp8_kv_cache_stores_e4m3_and_reads_the_model_dtype(target):
    """The reference store and gather: K / k_scale, V / v_scale saturated at +-448; read back times the
    scales in the model's dtype; a page takes a quarter of an fp32 page."""
    from blockspec.models.kv_cache import FP8, KVCache, causal_meta, quantize_kv

    cache = KVCache(2, 2, 8, 32, torch.float32, "cpu", 2, FP8, k_scale=0.5, v_scale=4.0)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g) * 100
    v[0, 0, 0, 0] = 5000.0
    meta = causal_meta([0, 1], [3, 0], [5, 5], 5, cache.trash, "cpu")
    cache.write(1, meta, k, v)
    keys, values = cache.read(1, meta)
    assert keys.dtype == values.dtype == torch.float32 and cache.k[1].dtype == FP8
    assert torch.equal(keys[0, :, 3:8], quantize_kv(k[0], 0.5).float() * 0.5)
    assert torch.equal(values[1, :, :5], quantize_kv(v[1], 4.0).float() * 4.0)
    assert values[0, 0, 3, 0] == 448.0 * 4.0  # saturated, not inf
    assert ((keys[0, :, 3:8] - k[0]).abs() <= k[0].abs() * 2**-4 + 2**-10).all()  # e4m3 rounding at most
    assert KVCache.page_bytes(2, 2, 8, 64, FP8) * 4 == KVCache.page_bytes(2, 2, 8, 64, torch.float32)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int8")


def with_kv_scales(src: Path, dst: Path, names: str, scales: dict[int, tuple[float, float]] | None = None,
                   extra: dict[str, torch.Tensor] | None = None) -> Path:
    """`src` with its K and V values scaled up past e4m3's +-448 (k_norm x 1000 and q_norm / 1000, v_proj x 2000
    and o_proj / 2000, so the fp32 model's output is the same up to rounding), and each layer's cache scales
    (`scales`, else the K and V amax of a prefill of IDS over 448) under `names` ("{kind}" is k or v; "kv" one
    tensor for both)."""
    state = load_file(str(src / "model.safetensors"))
    for name in list(state):
        if ".self_attn.k_norm." in name:
            state[name] = state[name] * 1000
        elif ".self_attn.q_norm." in name:
            state[name] = state[name] / 1000
        elif ".self_attn.v_proj." in name:
            state[name] = state[name] * 2000
        elif ".self_attn.o_proj." in name:
            state[name] = state[name] / 2000
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(state, str(dst / "model.safetensors"))
    if scales is None:  # calibrated as a checkpoint's are: amax over 448, here on the text the test decodes
        model, _ = load_target(dst, "float32", "cpu", 128)
        cache = model.new_cache(1, 64)
        meta = causal_meta([0], [0], [IDS.shape[1]], IDS.shape[1], cache.trash, "cpu")
        with torch.no_grad():
            model(IDS, meta, cache)
        scales = {i: (float(cache.k[i].abs().max()) / fp8.E4M3_MAX, float(cache.v[i].abs().max()) / fp8.E4M3_MAX)
                  for i in range(len(model.layers))}
    for i, (k, v) in scales.items():
        if names == "kv":
            state[f"model.layers.{i}.self_attn.kv_scale"] = torch.tensor(max(k, v))
        else:
            for kind, value in (("k", k), ("v", v)):
                state[f"model.layers.{i}.self_attn.{names.format(kind=kind)}"] = torch.tensor([value])
    state.update(extra or {})
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("names", ["{kind}_scale", "attn.{kind}_scale", "{kind}_proj.{kind}_scale",
                                   "{kind}_proj.output_scale", "kv"])
def test_a_checkpoints_kv_cache_scales_keep_large_keys_and_values(target, tmp_path, names):
    """K and V far past +-448: an FP8 cache at the checkpoint's per-layer scales (every format's names; its
    query and softmax scales, unused, dropped) stays near the fp32 cache's logits, while scale 1.0
    saturates them (the control). `kv_cache_dtype="fp8"` then stores under those scales, and speculation
    stays exact against the scaled cache's plain decoding."""
    extra = {"model.layers.0.self_attn.q_scale": torch.tensor(1.0),
             "model.layers.0.self_attn.prob_scale": torch.tensor(1.0),
             "model.layers.0.self_attn.q_proj.output_scale": torch.tensor([1.0])}
    path = with_kv_scales(target, tmp_path / "scaled", names, extra=extra)
    model, _ = load_target(path, "float32", "cpu", 128)
    assert model.kv_scales is not None and min(model.kv_scales.k + model.kv_scales.v) > 1.0
    with torch.no_grad():
        reference = logits(model, IDS)
        model.kv_cache_dtype = fp8.FP8
        scaled = logits(model, IDS)
        scales, model.kv_scales = model.kv_scales, None
        saturated = logits(model, IDS)
    error = (scaled - reference).abs().max() / reference.abs().max()
    assert error < 0.05 and (saturated - reference).abs().max() / reference.abs().max() > 4 * error

    ps = prompts(3, seed=5)
    plain = LLM(str(path), device="cpu", max_model_len=160, kv_cache_dtype="fp8")
    assert plain.engine.runner.cache.k_scales == scales.k and plain.engine.runner.cache.v_scales == scales.v
    expected = run(plain, ps, GREEDY)
    llm = LLM(str(path), device="cpu", max_model_len=160, kv_cache_dtype="fp8", speculative_config={
        "method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False})
    assert llm.engine.context.cache.k_scales == (1.0,) * len(llm.engine.context.cache.k)  # the drafter's: none
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected


def with_one_loud_head(src: Path, dst: Path, per_head: bool) -> Path:
    """`src` with KV head 0's V 10^5 times what it was (v_proj's head-0 rows x 1e5, the o_proj columns of the
    query heads reading it / 1e5: the fp32 model's output the same up to rounding) and calibrated V scales:
    amax over 448 of a prefill of IDS, of each KV head ([kv_heads, 1, 1], compressed-tensors' "attn_head"
    shape) or of the layer (the loudest head's); K per layer either way."""
    state = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    group = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    for name in list(state):
        if name.endswith(".self_attn.v_proj.weight"):
            state[name] = torch.cat([state[name][:hd] * 1e5, state[name][hd:]])
        elif name.endswith(".self_attn.o_proj.weight"):
            state[name] = torch.cat([state[name][:, : group * hd] / 1e5, state[name][:, group * hd :]], dim=1)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(dst / "model.safetensors"))
    model, _ = load_target(dst, "float32", "cpu", 128)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(IDS, causal_meta([0], [0], [IDS.shape[1]], IDS.shape[1], cache.trash, "cpu"), cache)
    for i in range(len(model.layers)):
        state[f"model.layers.{i}.self_attn.k_scale"] = cache.k[i].abs().max() / fp8.E4M3_MAX
        v = cache.v[i].abs().amax(dim=(0, 2, 3)) / fp8.E4M3_MAX  # [kv_heads]
        state[f"model.layers.{i}.self_attn.v_scale"] = v.view(-1, 1, 1) if per_head else v.max()
    save_file(state, str(dst / "model.safetensors"))
    return dst


def test_per_head_kv_cache_scales_keep_a_quiet_head_beside_a_loud_one(target, tmp_path):
    """One KV head's V 10^5 times the other's: at one scale a layer (the loud head's amax over 448) the quiet
    head's values fall below e4m3's normal range and the logits drift; at a scale a KV head both heads keep
    e4m3's precision, near the fp32 cache's logits. Speculation over the per-head cache is exact, and 2
    tensor-parallel ranks, each with its own head's scales, give the single process's tokens."""
    errors = {}
    for per_head in (True, False):
        path = with_one_loud_head(target, tmp_path / f"heads_{per_head}", per_head)
        model, _ = load_target(path, "float32", "cpu", 128)
        assert all(isinstance(v, tuple) == per_head for v in model.kv_scales.v)
        with torch.no_grad():
            reference = logits(model, IDS)
            model.kv_cache_dtype = fp8.FP8
            errors[per_head] = float((logits(model, IDS) - reference).abs().max() / reference.abs().max())
    assert errors[True] < 0.05 and errors[False] > 4 * errors[True], errors

    ps = prompts(3, seed=6)
    plain = LLM(str(path.parent / "heads_True"), device="cpu", max_model_len=160, kv_cache_dtype="fp8", seed=0)
    cache = plain.engine.runner.cache
    assert all(isinstance(s, torch.Tensor) and s.shape == (2,) for s in cache.k_scales + cache.v_scales)
    assert all(float(v[0]) > 1e3 * float(v[1]) for v in cache.v_scales)
    expected = run(plain, ps, GREEDY)
    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    llm = LLM(str(path.parent / "heads_True"), device="cpu", max_model_len=160, kv_cache_dtype="fp8",
              speculative_config=spec, seed=0)
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected
    with LLM(str(path.parent / "heads_True"), device="cpu", max_model_len=160, kv_cache_dtype="fp8", seed=0,
             tensor_parallel_size=2) as tp:
        assert run(tp, ps, GREEDY) == expected


@pytest.mark.parametrize("fault, error", [
    ("heads", r"layers.1.self_attn.k_scale holds 3 values \(3,\); a KV cache scale is one value or one per KV "
              r"head \(2\)"),
    ("head_zero", r"layers.1.self_attn.v_scale holds 0.0; a KV cache scale must be positive and finite"),
    ("zero", r"layers.2.self_attn.v_scale is 0.0; a KV cache scale must be positive and finite"),
    ("nan", r"layers.0.self_attn.k_scale is nan"),
    ("missing", r"KV cache scales for some layers but not layers.3.k_scale, layers.3.v_scale"),
    ("twice", r"layer 1 has two K cache scales: model.layers.1.self_attn.k_scale and "
              r"model.layers.1.self_attn.kv_scale"),
    ("past", r"layers.9.self_attn.k_scale names layer 9, but the model has 5 layers")])
def test_broken_kv_cache_scales_are_refused_naming_the_tensor(target, tmp_path, fault, error):
    path = with_kv_scales(target, tmp_path / "scaled", "{kind}_scale", {i: (2.0, 3.0) for i in range(5)})
    state = load_file(str(path / "model.safetensors"))
    if fault == "heads":
        state["model.layers.1.self_attn.k_scale"] = torch.tensor([2.0, 2.5, 3.0])
    elif fault == "head_zero":
        state["model.layers.1.self_attn.v_scale"] = torch.tensor([[[2.0]], [[0.0]]])
    elif fault in ("zero", "nan"):
        name = "model.layers.2.self_attn.v_scale" if fault == "zero" else "model.layers.0.self_attn.k_scale"
        state[name] = torch.tensor([0.0 if fault == "zero" else math.nan])
    elif fault == "missing":
        del state["model.layers.3.self_attn.k_scale"], state["model.layers.3.self_attn.v_scale"]
    elif fault == "twice":
        state["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    else:
        state["model.layers.9.self_attn.k_scale"] = torch.tensor(2.0)
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=error):
        load_target(path, "float32", "cpu", 128)


def test_speculation_on_an_fp8_checkpoint_is_exact(target, tmp_path):
    path = write_fp8(target, tmp_path, "block32") / "fp8"
    plain = LLM(str(path), device="cpu", max_model_len=160)
    ps = prompts(3, seed=4)
    expected = run(plain, ps, GREEDY)
    llm = LLM(str(path), device="cpu", max_model_len=160,
              speculative_config={"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False})
    add_oracle(llm, {tuple(p["prompt_token_ids"]): e for p, e in zip(ps, expected)}, corrupt=0.2)
    assert run(llm, ps, GREEDY) == expected


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_an_fp8_drafter_drafts_from_e4m3_weights_and_decoding_stays_exact(target, unquantized, method, fixture):
    """speculative_config quantization="fp8" (vLLM's field) quantizes the drafter's decoder products at
    load; the target is untouched, and greedy and seeded sampling stay the target's plain decoding. A
    method that is not supported is refused naming the field."""
    ps = prompts(4, seed=5)
    spec = {"method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False}
    llm = LLM(str(target), device="cpu", max_model_len=160, speculative_config={**spec, "quantization": "fp8"})
    drafter = llm.engine.context.drafter
    assert isinstance(drafter.layers[0].mlp.down_proj, Fp8Linear) and not is_quantized(llm.engine.model)
    assert run(llm, ps, GREEDY) == run(unquantized, ps, GREEDY)
    assert llm.get_stats()["num_drafts"] > 0
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=20, ignore_eos=True)
    assert run(llm, ps, sampled) == run(unquantized, ps, sampled)
    with pytest.raises(ConfigError, match="speculative_config.quantization 'int4' is not supported; supported: fp8"):
        LLM(str(target), device="cpu", max_model_len=160, speculative_config={**spec, "quantization": "int4"})


def test_cpu_products_keep_the_dequantized_weight_until_it_changes():
    """Without kernels an FP8 linear computes with `dequantize_reference`'s weight, made once: bit for bit
    the reference product, made again when the weight's scales change in place (a stale copy would keep the
    old outputs)."""
    g = torch.Generator().manual_seed(5)
    lin = Fp8Linear.from_linear(nn.Linear(64, 48))
    x = torch.randn(3, 64, generator=g)

    def reference() -> torch.Tensor:
        return F.linear(x, fp8.dequantize_reference(lin.weight, lin.weight_scale, lin.block, torch.float32), lin.bias)

    assert torch.equal(lin(x), reference()) and lin.dequantized(torch.float32) is lin.dequantized(torch.float32)
    before = lin(x)
    with torch.no_grad():
        lin.weight_scale.mul_(2)
    assert torch.equal(lin(x), reference())
    assert not torch.allclose(lin(x), before, rtol=1e-3, atol=1e-3)
