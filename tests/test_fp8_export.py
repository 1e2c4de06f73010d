"""`blockspec quantize` (models.fp8_export): the FP8 checkpoint it writes is the HF fine-grained format
that models.quant reads, holds exactly the block quantization of the source's products (its dequantized
weights give the same logits within float32 rounding; the source's own weights do not), keeps what
is not a decoder product as it was, decodes exactly under speculation, writes KV cache scales calibrated on
text when given some, and bad requests are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec import LLM, SamplingParams
from blockspec.cli import main as cli_main
from blockspec.config import ConfigError
from blockspec.kernels import fp8
from blockspec.models.fp8_export import calibration_sequences, write_fp8_checkpoint
from blockspec.models.kv_cache import causal_meta
from blockspec.models.loader import load_target
from blockspec.models.quant import Fp8Linear
from factories import save_drafter_target, save_moe_target
from test_quant import IDS, logits
from test_spec import FIXTURES, prompts, run


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("source"), tokenizer=True)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory) -> Path:
    return write_fp8_checkpoint(source, tmp_path_factory.mktemp("fp8") / "out", block=32).out


def test_the_checkpoint_is_the_block_quantization_of_the_products(source, exported):
    config = json.loads((exported / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [32, 32]}
    before, after = load_file(str(source / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    products = [n for n in before if ".layers." in n and n.endswith("_proj.weight")]
    assert len(products) == 7 * 5
    for name in products:
        q, s = fp8.quantize_blocks(before[name], (32, 32))
        assert after[name].dtype == torch.float8_e4m3fn and torch.equal(after[name].float(), q.float())
        assert torch.equal(after[name.removesuffix(".weight") + ".weight_scale_inv"], s)
    kept = [n for n in before if n not in products]
    assert kept and all(torch.equal(after[n], before[n]) for n in kept)  # embeddings, norms
    assert (exported / "tokenizer.json").is_file()


def test_the_written_model_is_its_dequantized_weights_not_the_sources(source, exported, tmp_path):
    after = load_file(str(exported / "model.safetensors"))
    dequantized = {n: t for n, t in after.items() if not n.endswith("_scale_inv")}
    for name in [n for n in dequantized if n.endswith("_proj.weight")]:
        scale = after[name.removesuffix(".weight") + ".weight_scale_inv"]
        dequantized[name] = fp8.dequantize_reference(after[name], scale, (32, 32), torch.float32)
    ref_dir = tmp_path / "dequantized"
    ref_dir.mkdir()
    save_file(dequantized, str(ref_dir / "model.safetensors"))
    (ref_dir / "config.json").write_text((source / "config.json").read_text())
    ours, _ = load_target(exported, "float32", "cpu", 128)
    ref, _ = load_target(ref_dir, "float32", "cpu", 128)
    orig, _ = load_target(source, "float32", "cpu", 128)
    assert isinstance(ours.layers[0].self_attn.qkv_proj, Fp8Linear) and isinstance(ours.layers[4].mlp.down_proj,
                                                                                     Fp8Linear)
    with torch.no_grad():
        got = logits(ours, IDS)
        assert (got - logits(ref, IDS)).abs().max() < 1e-5
        assert (got - logits(orig, IDS)).abs().max() > 1e-3  # the source's own weights: not what was written


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_speculation_on_the_written_checkpoint_equals_its_plain_decoding(exported, method, fixture):
    ps, params = prompts(4, seed=2), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run(LLM(str(exported), device="cpu", dtype="float32", max_model_len=128), ps, params)
    llm = LLM(str(exported), device="cpu", dtype="float32", max_model_len=128,
              speculative_config={"method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False})
    assert run(llm, ps, params) == plain and llm.get_stats()["num_accepted_tokens"] > 0


@pytest.mark.parametrize("layout", ["per expert", "stacked"])
def test_a_mixture_of_experts_checkpoint_has_its_experts_in_e4m3(tmp_path, layout):
    """Attention, the dense layer's MLP and every expert (one by one, as the hub stores them) in e4m3;
    routers as they were. It loads into e4m3 `Fp8Experts` and decodes as its dequantized weights do.
    A source in transformers 5's stacked layout (gate_up [E, 2I, H], down [E, H, I]) is written one by
    one too, each expert's gate, up and down the stacked tensors' slices."""
    from blockspec.models.moe import stack_experts
    from blockspec.models.quant import Fp8Experts

    source = save_moe_target(tmp_path / "moe")
    if layout == "stacked":
        hub = load_file(str(source / "model.safetensors"))
        fused = {}
        for name, t in hub.items():  # gate and up fused per expert, then every layer's experts stacked
            if ".experts." not in name:
                fused[name] = t
            elif ".gate_proj." in name:
                fused[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat(
                    [t, hub[name.replace(".gate_proj.", ".up_proj.")]])
            elif ".up_proj." not in name:
                fused[name] = t
        stacked = stack_experts(fused, "test")
        assert stacked["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
        save_file(stacked, str(source / "model.safetensors"))
    out = write_fp8_checkpoint(source, tmp_path / "fp8", block=16).out
    state = load_file(str(out / "model.safetensors"))
    if layout == "stacked":
        want = hub["model.layers.3.mlp.experts.6.up_proj.weight"]
        scale = state["model.layers.3.mlp.experts.6.up_proj.weight_scale_inv"]
        w = state["model.layers.3.mlp.experts.6.up_proj.weight"].float()
        w = w * scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[: w.shape[0], : w.shape[1]]
        assert w.shape == want.shape and torch.allclose(w, want, rtol=2**-3, atol=1e-6)
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in state)
    fp8_names = {n for n, t in state.items() if t.dtype == torch.float8_e4m3fn}
    experts = {n for n in state if ".experts." in n and n.endswith("_proj.weight")}
    assert experts and experts <= fp8_names and not any(".gate.weight" in n for n in fp8_names)
    assert "model.layers.2.mlp.gate_proj.weight" in fp8_names and "model.layers.0.self_attn.q_proj.weight" in fp8_names
    assert "model.layers.0.mlp.experts.5.down_proj.weight_scale_inv" in state
    model, _ = load_target(out, "float32", "cpu", 64)
    assert isinstance(model.layers[0].mlp.experts, Fp8Experts) and model.layers[0].mlp.experts.down_block == (16, 16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(run(LLM(str(out), device="cpu", dtype="float32", max_model_len=64), prompts(2, seed=0), params)[0]) == 8


def test_bad_requests_are_refused_by_name(source, exported, tmp_path, capsys):
    with pytest.raises(ConfigError, match="new or empty directory"):
        write_fp8_checkpoint(source, exported)
    with pytest.raises(ConfigError, match="quantized already"):
        write_fp8_checkpoint(exported, tmp_path / "again")
    with pytest.raises(ConfigError, match=r"block_size must be in \[1, 1024\]"):
        write_fp8_checkpoint(source, tmp_path / "zero", block=0)
    assert cli_main(["quantize", str(exported), "--out", str(tmp_path / "cli")]) == 2
    assert "quantized already" in capsys.readouterr().err
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "cli"), "--block-size", "64"]) == 0
    said = capsys.readouterr()
    assert "e4m3 (64 x 64 blocks)" in said.out
    assert "are not whole 64 x 64 blocks: blockspec and transformers load them, vLLM" in said.err  # 32 and 72 wide
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "whole"), "--block-size", "8"]) == 0
    assert "warning" not in capsys.readouterr().err
    written = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert written["quantization_config"]["weight_block_size"] == [64, 64]


def test_an_interrupted_export_leaves_no_half_checkpoint(source, tmp_path, monkeypatch):
    """The checkpoint is written beside --out and renamed into place whole: a run stopped while writing leaves
    --out as it was (absent, or the empty directory given) and nothing else behind."""
    import blockspec.models.fp8_export as fp8_export

    def stopped(state, directory):
        (Path(directory) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fp8_export, "save_torch_state_dict", stopped)
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(KeyboardInterrupt):
            write_fp8_checkpoint(source, out, block=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    monkeypatch.undo()
    out = write_fp8_checkpoint(source, tmp_path / "empty", block=32).out
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_tied_model_stored_as_bin_keeps_its_embedding(tmp_path):
    """torch.save stores a tied model's embedding and head as one tensor under both names: the export kept the
    head and dropped the embedding, and its checkpoint did not load. The embedding is written, the tied head
    left out, and the FP8 model gives the logits of the safetensors source's export."""
    from factories import save_tiny

    source = save_tiny(tmp_path / "tied", "qwen3", seed=3, tie=True)
    state = load_file(str(source / "model.safetensors"))
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # one storage, two names
    (source / "model.safetensors").unlink()
    torch.save(state, source / "pytorch_model.bin")
    written = write_fp8_checkpoint(source, tmp_path / "fp8", block=16)
    out = load_file(str(written.out / "model.safetensors"))
    assert "model.embed_tokens.weight" in out and "lm_head.weight" not in out
    model, _ = load_target(written.out, "float32", "cpu", 64)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert written.bytes_before == sum(t.nbytes for n, t in state.items() if n != "lm_head.weight")


def test_quantize_refuses_a_drafter_and_a_block_past_its_bound(tmp_path, capsys):
    """A drafter's FP8 twin would not load (a drafter goes FP8 at load); a 100000-wide block tried to allocate
    tens of GB. Both one line, before any work."""
    from blockspec.assets import PAIR

    if not (PAIR / "dflash" / "config.json").is_file():
        pytest.skip("the embedded pair is not installed")
    assert cli_main(["quantize", str(PAIR / "dflash"), "--out", str(tmp_path / "d")]) == 2
    assert "is a drafter (DFlashDraftModel): quantize writes FP8 targets" in capsys.readouterr().err
    assert cli_main(["quantize", "default", "--out", str(tmp_path / "b"), "--block-size", "100000"]) == 2
    assert "block_size must be in [1, 1024]" in capsys.readouterr().err
    assert cli_main(["quantize", "default", "--out", str(tmp_path / "t"), "--device", "tpu"]) == 2  # it passed
    assert "device 'tpu' not understood" in capsys.readouterr().err and not (tmp_path / "t").exists()


def test_quantize_default_names_the_embedded_target(tmp_path, capsys):
    from blockspec.assets import PAIR

    if not (PAIR / "target" / "config.json").is_file():
        pytest.skip("the embedded pair is not installed")
    assert cli_main(["quantize", "default", "--out", str(tmp_path / "fp8")]) == 0
    assert "e4m3 (128 x 128 blocks)" in capsys.readouterr().out
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_kv_cache_scales_are_the_calibration_texts_amax_over_448(source, tmp_path, capsys):
    """`--kv-calibration`: each layer's k_scale / v_scale is the largest |K| (normed, rotated) and |V| the
    source's prefills of the text store, over 448, under the names the loader reads back; an FP8 cache of the
    written checkpoint then stores under them. Calibration text is cut into prefills and capped in tokens."""
    text = tmp_path / "calibration.txt"
    text.write_text("def f(x):\n    return [x * i for i in range(10)]\n" * 12)
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "cli"), "--block-size", "32",
                     "--kv-calibration", str(text), "--kv-calibration-tokens", "300", "--device", "cpu"]) == 0
    assert "KV cache scales of 5 layers from 300 tokens" in capsys.readouterr().out
    written = load_file(str(tmp_path / "cli" / "model.safetensors"))

    from blockspec.engine.build import load_tokenizer

    sequences = calibration_sequences(load_tokenizer(source), [text.read_text()], 300, length=2048)
    assert [len(s) for s in sequences] == [300]
    model, _ = load_target(source, "float32", "cpu", 512)
    cache = model.new_cache(1, 300)
    with torch.no_grad():
        model(torch.tensor(sequences), causal_meta([0], [0], [300], 300, cache.trash, "cpu"), cache)
    for i in range(5):
        for kind, pool in (("k", cache.k[i]), ("v", cache.v[i])):
            expected = pool.abs().max() / fp8.E4M3_MAX
            assert torch.allclose(written[f"model.layers.{i}.self_attn.{kind}_scale"], expected, rtol=1e-6)
    llm = LLM(str(tmp_path / "cli"), device="cpu", dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
    assert llm.engine.runner.cache.k_scales[2] == pytest.approx(float(written["model.layers.2.self_attn.k_scale"]))
    assert [len(s) for s in calibration_sequences(load_tokenizer(source), ["ab" * 700, "c" * 50], 1000, 512)] == [
        512, 488]
    # sequences longer than the model's positions (512) are prefilled in pieces of that length
    from blockspec.models.fp8_export import calibrate_kv_scales

    long = (sequences[0] * 3)[:700]
    assert calibrate_kv_scales(source, [long], "cpu") == calibrate_kv_scales(source, [long[:512], long[512:]], "cpu")
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "none"), "--kv-calibration",
                     str(tmp_path / "missing.txt")]) == 2
    assert "--kv-calibration: no such file" in capsys.readouterr().err

    # --kv-scales head: each KV head's amax over 448, [kv_heads, 1, 1], read back per head
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "heads"), "--block-size", "32",
                     "--kv-calibration", str(text), "--kv-calibration-tokens", "300", "--device", "cpu",
                     "--kv-scales", "head"]) == 0
    assert "KV cache scales of 5 layers per KV head from 300 tokens" in capsys.readouterr().out
    heads = load_file(str(tmp_path / "heads" / "model.safetensors"))
    for i in range(5):
        for kind, pool in (("k", cache.k[i]), ("v", cache.v[i])):
            expected = pool.abs().amax(dim=(0, 2, 3)).view(-1, 1, 1) / fp8.E4M3_MAX
            assert torch.allclose(heads[f"model.layers.{i}.self_attn.{kind}_scale"], expected, rtol=1e-6)
            assert torch.allclose(expected.max(), written[f"model.layers.{i}.self_attn.{kind}_scale"], rtol=1e-6)
    llm = LLM(str(tmp_path / "heads"), device="cpu", dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
    assert torch.allclose(llm.engine.runner.cache.v_scales[3], heads["model.layers.3.self_attn.v_scale"].view(-1))
    assert cli_main(["quantize", str(source), "--out", str(tmp_path / "none"), "--kv-scales", "head"]) == 2
    assert "--kv-scales head: per-head KV cache scales are calibrated; give --kv-calibration FILE" in \
        capsys.readouterr().err
