"""Target models against transformers on the same tiny checkpoints; loader errors."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from blockspec import LLM
from blockspec.config import ConfigError, EngineArgs
from blockspec.engine.build import build_engine
from blockspec.models.kv_cache import causal_meta
from blockspec.models.loader import load_target
from blockspec.errors import ModelLoadError
from factories import FAMILIES, assert_incremental_matches_full, save_tiny, save_tiny_model_with_tokenizer

CASES = [(fam, tie) for fam in FAMILIES for tie in (False, True)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def pair(request, tmp_path_factory):
    family, tie = request.param
    path = save_tiny(tmp_path_factory.mktemp(family), family, seed=3, tie=tie)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours, _ = load_target(path, dtype="float32", device="cpu", max_positions=512)
    return hf, ours


def test_prefill_logits_and_taps_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 96, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    cache = ours.new_cache(2, 64)
    layers = ours.config.num_hidden_layers
    taps = (-1, 0, layers // 2, layers - 1)
    meta = causal_meta([1], [0], [33], 33, cache.trash, "cpu", layer_types=ours.config.layer_types)
    hidden, feats = ours(ids, meta, cache, taps)
    logits = ours.compute_logits(hidden)
    assert (logits - ref.logits).abs().max() < 1e-4
    expect = torch.cat([ref.hidden_states[t + 1] for t in taps], dim=-1)
    assert (feats - expect).abs().max() < 1e-4


def test_a_tied_config_with_its_own_head_keeps_the_head_as_transformers_does(tmp_path, caplog):
    """tie_word_embeddings true, yet the checkpoint holds an lm_head.weight unlike the embedding: transformers
    keeps the two apart (with a warning), so blockspec does too; it used to tie them and drop the head, giving
    another model's logits without a word."""
    import logging

    from safetensors.torch import save_file

    path = save_tiny(tmp_path / "m", "qwen3", seed=3, tie=True)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(weights), metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        ours, _ = load_target(path, dtype="float32", device="cpu", max_positions=64)
    assert "lm_head.weight differs from the embedding" in caplog.text
    assert torch.equal(ours.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(hf.lm_head.weight, state["lm_head.weight"])
    tied, _ = load_target(save_tiny(tmp_path / "t", "qwen3", seed=3, tie=True), dtype="float32", device="cpu",
                          max_positions=64)
    assert tied.lm_head.weight is tied.embed_tokens.weight  # a checkpoint without its own head stays tied


def test_incremental_decode_matches_full_forward(pair):
    """Cache written in chunks of different sizes gives the same logits as one pass."""
    _, ours = pair
    assert_incremental_matches_full(ours, 20, (7, 1, 5, 1, 6))


def test_batched_padded_rows_equal_single(pair):
    """Requests of different lengths in one padded batch equal each run alone."""
    _, ours = pair
    g = torch.Generator().manual_seed(2)
    lens = [5, 12, 1]
    seqs = [torch.randint(0, 96, (n,), generator=g) for n in lens]
    cache = ours.new_cache(4, 64)
    batch = torch.zeros(3, 12, dtype=torch.int64)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    meta = causal_meta([3, 0, 1], [0, 0, 0], lens, 12, cache.trash, "cpu", layer_types=ours.config.layer_types)
    out = ours.compute_logits(ours(batch, meta, cache)[0])
    for i, s in enumerate(seqs):
        c2 = ours.new_cache(1, 64)
        m2 = causal_meta([0], [0], [len(s)], len(s), c2.trash, "cpu", layer_types=ours.config.layer_types)
        alone = ours.compute_logits(ours(s[None], m2, c2)[0])
        assert (out[i, : len(s)] - alone[0]).abs().max() < 1e-4


def test_sharded_checkpoint_loads(tmp_path):
    path = save_tiny(tmp_path / "m", "qwen2", seed=1, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    model, _ = load_target(path, device="cpu")
    assert model.config.model_type == "qwen2" and model.config.qkv_bias


def test_sharded_pytorch_bin_checkpoint_loads_as_its_safetensors(tmp_path):
    """Older checkpoints ship pytorch_model-0000N-of-0000M.bin shards with pytorch_model.bin.index.json: the
    same tensors as the safetensors file they were written from."""
    path = save_tiny(tmp_path / "m", "llama", seed=2)
    want, _ = load_target(path, device="cpu")
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / file)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}))
    got, _ = load_target(path, device="cpu")
    theirs = dict(want.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in got.named_parameters()) and len(theirs) > 5


def test_malformed_shard_index_and_unreadable_bin_are_named(tmp_path):
    """A sharded index whose weight_map names no file, and a truncated pytorch_model.bin, fail with one line
    naming the file (not a TypeError from joining a path, or pickle's error naming nothing)."""
    path = save_tiny(tmp_path / "m", "qwen2", seed=1, max_shard_size="20KB")
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = 3
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(index))}: weight_map\['{re.escape(first)}'\] must name "
                                             "a shard file, got 3$"):
        load_target(path, device="cpu")
    path = save_tiny(tmp_path / "b", "llama")
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")
    (path / "pytorch_model.bin").write_bytes((path / "pytorch_model.bin").read_bytes()[:300])
    with pytest.raises(ModelLoadError, match=rf"^{re.escape(str(path / 'pytorch_model.bin'))}: cannot read the "
                                             "checkpoint: "):
        load_target(path, device="cpu")


def test_missing_directory_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_target(tmp_path / "nope")


def test_unsupported_architecture_is_named(tmp_path):
    path = save_tiny(tmp_path / "m", "qwen3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        load_target(path)
    # a classifier under a causal LM's model_type loaded as a causal LM, its score head dropped without a word
    cfg["model_type"], cfg["architectures"] = "qwen3", ["Qwen3ForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"architectures \['Qwen3ForSequenceClassification'\] are not supported"):
        load_target(path)


def test_malformed_config_and_bad_shapes(tmp_path):
    path = save_tiny(tmp_path / "m", "llama")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_target(path)
    path = save_tiny(tmp_path / "m2", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="checkpoint shape"):
        load_target(path)
    cfg["num_key_value_heads"] = 3
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_target(path)
    # one part of a fused product of the wrong width: named (it was torch.cat's "Sizes of tensors must match")
    from safetensors.torch import save_file

    path = save_tiny(tmp_path / "m3", "llama")
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:, :-2].contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.mlp\.gate_up_proj\.weight: its parts' shapes past the "
                                             r"output rows differ: gate_proj \[\d+, \d+\], up_proj"):
        load_target(path)


@pytest.mark.parametrize("field, value, says", [
    ("hidden_act", "gelu", "'hidden_act' 'gelu' is not supported \\(silu only\\)"),
    ("hidden_size", True, "'hidden_size' must be a positive integer, got True"),
    ("num_key_value_heads", "2", "'num_key_value_heads' must be a positive integer"),
    ("head_dim", "32", "'head_dim' must be a positive integer"),
    ("rms_norm_eps", "x", "'rms_norm_eps' must be a positive number"),
    ("max_position_embeddings", "big", "'max_position_embeddings' must be a positive integer"),
    ("rope_theta", 0, "'rope_theta' must be a positive number"),
    ("rope_scaling", "linear", "'rope_scaling' must be an object"),
    ("rope_scaling", {"rope_type": "linear", "factor": "x"}, "\\(rope\\): field 'factor' must be a positive number"),
    ("torch_dtype", "float13", "'torch_dtype' 'float13' is not supported; allowed: float32"),
])
def test_config_fields_of_the_wrong_type_or_range_are_named(tmp_path, field, value, says):
    """A config.json value that would load a wrong model (an activation other than SwiGLU's, a RoPE of
    base 0) or fail deep in torch is refused up front, the field named (`LLM` and the CLI alike)."""
    path = save_tiny(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters", None) if field.startswith("rope") else None
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=says) as exc:
        LLM(str(path), device="cpu")
    assert str(exc.value).startswith(str(path / "config.json"))


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("tok") / "m")


@pytest.mark.parametrize("fields, says", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     "rope_scaling.original_max_position_embeddings is required for rope type llama3"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}},
     "rope_scaling.low_freq_factor, rope_scaling.high_freq_factor are required for rope type llama3"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is required for rope type linear"),
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 64}},
     "rope_scaling.factor is required for rope type yarn"),
    ({"use_sliding_window": True, "sliding_window": "big"},
     "field 'sliding_window' must be a positive integer, got 'big'"),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": "x", "layer_types": None},
     "field 'max_window_layers' must be an integer >= 0, got 'x'"),
    ({"use_sliding_window": "yes"}, "field 'use_sliding_window' must be true or false, got 'yes'"),
    ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false, got 'false'"),
    ({"attention_bias": "false"}, "field 'attention_bias' must be true or false, got 'false'"),
    ({"layer_types": "full_attention"}, "field 'layer_types' must be a list of strings, got 'full_attention'"),
    ({"eos_token_id": "x"}, "field 'eos_token_id' must be a token id \\(an integer >= 0\\), a list of them or null"),
    ({"eos_token_id": [1, "x"]}, "field 'eos_token_id' must be a token id"),
    ({"bos_token_id": [0]}, "field 'bos_token_id' must be a token id \\(an integer >= 0\\) or null, got \\[0\\]"),
])
def test_malformed_fields_are_named_before_transformers_reads_them(tmp_path, checkpoint_with_tokenizer, fields, says):
    """A field transformers' AutoConfig (which the tokenizer loads) would reject, or would fill in where
    blockspec guessed (llama3's original length), fails blockspec's own check first: one line naming the
    file and the field, not a KeyError or a multi-line dataclass error that blames the tokenizer."""
    path = tmp_path / "m"
    shutil.copytree(checkpoint_with_tokenizer, path)
    cfg = json.loads((path / "config.json").read_text())
    if "rope_scaling" in fields:  # a transformers-4 config: rope_theta + rope_scaling
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=says) as exc:
        LLM(str(path), device="cpu")
    assert str(exc.value).startswith(f"{path / 'config.json'}: ") and "\n" not in str(exc.value)


def test_config_is_checked_before_the_target_loads(tmp_path):
    """build_engine checks config.json before any loader (a tensor-parallel rank's too) or the tokenizer
    sees the directory."""
    path = save_tiny(tmp_path / "m", "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"].pop("original_max_position_embeddings")
    (path / "config.json").write_text(json.dumps(cfg))

    def loader(*args: object) -> None:
        raise AssertionError("the loader ran before config.json was checked")

    with pytest.raises(ConfigError, match="rope_parameters.original_max_position_embeddings is required"):
        build_engine(path, EngineArgs(device="cpu"), load=loader)


def test_yarn_without_original_length_uses_max_position_embeddings_as_transformers_does():
    """transformers fills a yarn rope's missing original_max_position_embeddings with
    max_position_embeddings; blockspec's tables must be the ones it computes (not a fixed 4096)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blockspec.config import rope_from_hf
    from blockspec.models.layers import rope_inv_freq

    raw = {"rope_theta": 1e6, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128,  # fills in a copy
                                  **{**raw, "rope_scaling": dict(raw["rope_scaling"])})
    want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    rope = rope_from_hf(raw, "config.json")
    assert rope.original_max_position_embeddings == 131072
    inv, scale = rope_inv_freq(rope, 128)
    assert torch.equal(inv, want.float()) and scale == pytest.approx(want_scale, rel=1e-12)


def test_scaled_rope_without_original_length_is_refused():
    """llama3 and yarn frequencies depend on the pre-training length: a RopeConfig built without one
    would leave rope_inv_freq to guess it."""
    from blockspec.config import RopeConfig

    for kind in ("llama3", "yarn"):
        with pytest.raises(ConfigError, match=f"rope type '{kind}' needs original_max_position_embeddings"):
            RopeConfig(type=kind, factor=8.0)


def test_missing_weights_file(tmp_path):
    path = save_tiny(tmp_path / "m", "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights found"):
        load_target(path)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0,
     "attention_factor": 1.3},
    # DeepSeek's attention factor from mscale / mscale_all_dim, and an unrounded correction range (both were ignored)
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "truncate": False},
])
def test_rope_tables_equal_transformers(scaling):
    """RoPE frequencies and attention scaling, read from the config.json transformers writes, equal
    transformers' own initialisers for every rope type blockspec supports; another factor does not."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from blockspec.config import rope_from_hf
    from blockspec.models.layers import rope_inv_freq

    kind = scaling["rope_type"]
    cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, rope_theta=1e6,
                                   rope_scaling=None if kind == "default" else dict(scaling),
                                   max_position_embeddings=131072)
    want = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu") if kind != "default" else (
        1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128)), 1.0)
    raw = cfg.to_dict()
    inv, scale = rope_inv_freq(rope_from_hf(raw, "config.json"), 128)
    assert torch.equal(inv, want[0].float()) and scale == pytest.approx(want[1], rel=1e-12)
    if kind != "default":  # negative control
        other = rope_from_hf({**raw, "rope_parameters": {**raw.get("rope_parameters", {}), "factor": 2.0}}, "c")
        assert not torch.equal(rope_inv_freq(other, 128)[0], inv)


@pytest.mark.parametrize("name", ["Qwen3Config", "Qwen2Config", "LlamaConfig", "MistralConfig"])
def test_fields_a_config_leaves_out_take_transformers_defaults(name):
    """A config.json without head_dim or sliding_window reads as transformers reads it: Qwen3Config's head_dim
    is 128 (not hidden / heads) and MistralConfig's window 4096 (not full attention); loading them otherwise
    made another model of the same weights, or refused it with a list of shape mismatches."""
    from blockspec.config import ModelConfig

    kind = getattr(transformers, name)
    raw = kind(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
               num_hidden_layers=2, vocab_size=128).to_dict()
    for field in ("head_dim", "sliding_window"):
        raw.pop(field, None)
    hf = kind.from_dict(dict(raw))
    ours = ModelConfig.from_hf(raw)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or 16)
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    assert (ours.head_dim, ours.sliding_window) == {"Qwen3Config": (128, None), "MistralConfig": (16, 4096)}.get(
        name, (16, None))


# (transformers config class, config.json fields over the tiny shape, the layers that slide, the window)
SLIDING_CASES = [
    ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=32), (0, 1, 2), 32),  # no per-layer rule: all
    ("Qwen2MoeConfig", dict(use_sliding_window=True, sliding_window=32, max_window_layers=3), None, 32),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=32, num_hidden_layers=30), None, 32),  # from 28
    ("Qwen3Config", dict(use_sliding_window=True, sliding_window=32, num_hidden_layers=30), None, 32),
    ("Qwen3Config", dict(use_sliding_window=False, sliding_window=32), (), None),  # the flag off: a window unused
    ("MistralConfig", dict(sliding_window=32, use_sliding_window=False), (0, 1, 2), 32),  # not Mistral's field
    ("LlamaConfig", dict(sliding_window=32, use_sliding_window=True,
                         layer_types=["sliding_attention"] * 3), (), None),  # Llama never slides
]


@pytest.mark.parametrize("name, fields, sliding, window", SLIDING_CASES)
def test_sliding_layers_are_read_as_transformers_reads_each_family(name, fields, sliding, window):
    """Which layers slide, from config.json as hub checkpoints write it (no layer_types where transformers 5
    would add them): each family has its own rule, and a rule of another family made a different model in
    silence (Qwen3-MoE attended in full everywhere, Qwen2-MoE on the wrong layers, a missing max_window_layers
    read as all of them, Mistral dropped its window for a field it does not have)."""
    from blockspec.config import ModelConfig

    kind = getattr(transformers, name)
    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 num_hidden_layers=3, vocab_size=128, **({"num_experts": 4, "moe_intermediate_size": 32,
                                                           "num_experts_per_tok": 2} if "Moe" in name else {}))
    raw = {**kind(**shape).to_dict(), **fields}
    if "layer_types" not in fields:
        raw.pop("layer_types", None)
    hf = kind(**{k: v for k, v in raw.items() if k != "layer_types" or "layer_types" in fields})
    ours = ModelConfig.from_hf(raw)
    if sliding is None:  # the families that write layer_types: theirs from the same fields
        sliding = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert tuple(i for i, t in enumerate(ours.layer_types) if t == "sliding_attention") == sliding
    assert ours.sliding_window == window and (window is None or sliding)
    assert ModelConfig.from_hf(ours.to_hf()) == ours  # blockspec writes what it reads (the bench's peer models)


def test_top_level_rope_fields_and_swish_read_as_in_transformers():
    """A top-level original_max_position_embeddings wins over the rope dict's (transformers' rule for llama3 and
    yarn); hidden_act "swish" is SiLU in transformers, so it loads."""
    from blockspec.config import ModelConfig, rope_from_hf

    raw = {"max_position_embeddings": 256, "original_max_position_embeddings": 32,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    assert rope_from_hf(raw, "config.json").original_max_position_embeddings == 32
    tiny = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, num_hidden_layers=2, vocab_size=128).to_dict()
    assert ModelConfig.from_hf({**tiny, "hidden_act": "swish"}).num_hidden_layers == 2
    with pytest.raises(ConfigError, match="'hidden_act' 'gelu' is not supported"):
        ModelConfig.from_hf({**tiny, "hidden_act": "gelu"})


def test_rope_scaling_beside_rope_parameters_wins_as_in_transformers():
    """A config with both fields (a transformers-4 rope_scaling left beside a 5.x rope_parameters): transformers
    takes rope_scaling whole, and so must blockspec, or its tables are another model's."""
    from blockspec.config import rope_from_hf

    raw = {"rope_theta": 1e6, "max_position_embeddings": 131072, "hidden_size": 512, "num_attention_heads": 4,
           "head_dim": 128, "rope_scaling": {"rope_type": "linear", "factor": 4.0},
           "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    theirs = transformers.LlamaConfig(**raw).rope_parameters
    ours = rope_from_hf(raw, "config.json")
    assert (ours.type, ours.factor) == (theirs["rope_type"], theirs["factor"]) == ("linear", 4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_qwen3s_bit_for_bit(dtype):
    """blockspec's RMSNorm against transformers' Qwen3RMSNorm on the same rows and weight, across widths,
    row counts and magnitudes: fp32 takes one fused call, 16-bit rows the fp32 ops cast back; both must
    give HF's bits, or a target's logits drift from its reference."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from blockspec.models.layers import rms_norm

    g = torch.Generator().manual_seed(0)
    for width, rows, scale in ((64, 1, 1e-3), (256, 9, 1.0), (1024, 3, 1e3), (4096, 17, 30.0)):
        ref = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            ref.weight.copy_(torch.randn(width, generator=g))
        x = (torch.randn(rows, width, generator=g) * scale).to(dtype)
        with torch.no_grad():
            assert torch.equal(rms_norm(x, ref.weight, 1e-6), ref(x))
