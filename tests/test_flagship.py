"""The flagship recipe's stages on a tiny corpus (CPU): sliced pretraining equals one run bit for bit, state
files stay under their size cap, regeneration writes pieces the corpus reader reads, a drafter stage resumes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from blockspec.engine.build import load_tokenizer
from blockspec.models.loader import load_target
from blockspec.train.corpus import load_piece, load_split, write_split_pieces
from blockspec.train.data import (
    Example,
    encode_texts,
    read_texts,
    save_tokenizer,
    stdlib_split,
    train_tokenizer,
)
from blockspec.train.drafter_stage import DrafterStageConfig, drafter_slice, export_best, open_stage
from blockspec.train.pretrain import PretrainConfig, pretrain_slice, resume_run
from blockspec.train.regen import RegenConfig, make_prompts, regen_slice
from blockspec.train.state import MAX_FILE_BYTES, load_state, save_state, state_files
from blockspec.train.stream import load_rows
from blockspec.train.target_lm import TargetShape, save_hf_target

CAP = 24 * 1024  # a small shard cap, so that the tiny model's tensors are cut and packed as the real ones are


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tokenizer and three train pieces (plus a validation piece) cut from stdlib sources, with a manifest."""
    root = tmp_path_factory.mktemp("corpus")
    texts = read_texts(stdlib_split().train[:40])
    tok = train_tokenizer(texts[:20], vocab_size=300, max_len=512)
    save_tokenizer(tok, root / "tokenizer")
    eos = np.array([tok.eos_token_id], dtype=np.uint16)
    stream = np.concatenate([part for ids in encode_texts(texts, tok) for part in (np.array(ids, np.uint16), eos)])
    train, valid = stream[:30000], stream[30000:34000]
    pieces = root / "pieces"
    pieces.mkdir()
    sidecars = write_split_pieces(train, "train", pieces, tok.eos_token_id, len(tok), "t", 9000, 1)
    write_split_pieces(valid, "validation", pieces, tok.eos_token_id, len(tok), "t", 1 << 20, 1)
    (root / "manifest.json").write_text(json.dumps({"splits": {"train": {"pieces": sidecars}}}))
    assert len(sidecars) >= 3
    return root, tok


def tiny_config(vocab: int) -> PretrainConfig:
    shape = TargetShape(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=16, max_position_embeddings=512)
    return PretrainConfig(shape=shape, seq_len=64, batch_size=8, lr=5e-3, warmup_frac=0.1, epochs=2.0,
                          eval_windows=4, eval_batch_size=4)


def slice_args(corpus):
    root, tok = corpus
    return dict(cfg=tiny_config(len(tok)), manifest=root / "manifest.json", tokenizer=tok, device="cpu",
                validation=root / "pieces" / "validation-00000.u16.xz", max_file_bytes=CAP)


@pytest.fixture(scope="module")
def pretrained(corpus, tmp_path_factory):
    """One uninterrupted run past every piece, and the same steps in two slices, the second starting
    where a piece was missing; the tiny target exported."""
    root, tok = corpus
    base = tmp_path_factory.mktemp("pretrain")
    whole = pretrain_slice(base / "whole", root / "pieces", max_steps=60, **slice_args(corpus))
    hand = base / "on-hand"  # a call that carried only the first piece
    hand.mkdir()
    for f in (root / "pieces").glob("train-00000.*"):
        shutil.copy(f, hand)
    first = pretrain_slice(base / "sliced", hand, max_steps=60, **slice_args(corpus))
    for f in (root / "pieces").glob("train-*"):
        shutil.copy(f, hand)
    second = pretrain_slice(base / "sliced", hand, max_steps=60 - first["steps"], device="cpu", max_file_bytes=CAP,
                            validation=root / "pieces" / "validation-00000.u16.xz")
    target = save_hf_target(resume_run(base / "whole", root / "pieces", torch.device("cpu")).model, base / "target",
                            tok, dtype="float32")
    return base, whole, first, second, target


def test_two_resumed_slices_equal_one_run_bit_for_bit(pretrained, corpus):
    base, whole, first, second, _ = pretrained
    assert first["stop"] == "piece" and first["next_piece"] == "train-00001.u16.xz"
    assert 0 < first["steps"] < 60 and second["to_step"] == whole["to_step"] == 60 and second["exact_resume"]
    a, b = load_state(base / "whole"), load_state(base / "sliced")
    assert a["run"]["position"] == b["run"]["position"] and a["run"]["position"]["epoch"] == 1  # past every piece
    for name, t in a["model"].items():
        assert torch.equal(t, b["model"][name]), name
    for i, moments in a["optimizer"]["state"].items():
        for key, t in moments.items():
            assert torch.equal(t, b["optimizer"]["state"][i][key]), (i, key)
    assert whole["valid_perplexity"] < tiny_config(len(corpus[1])).shape.vocab_size
    assert b["run"]["history"][-1]["valid_perplexity"] == whole["valid_perplexity"]


def test_state_files_stay_under_the_cap_and_without_moments_resume_from_weights(pretrained, corpus, tmp_path):
    base, *_ = pretrained
    files = state_files(base / "sliced")
    assert len(files) > 3 and all(f.stat().st_size <= CAP for f in files)
    copy = tmp_path / "weights-only"
    copy.mkdir()
    for f in state_files(base / "sliced", ["model", "run"]):
        shutil.copy(f, copy)
    resumed = pretrain_slice(copy, corpus[0] / "pieces", max_steps=2, device="cpu", max_file_bytes=CAP)
    assert resumed["to_step"] == 62 and not resumed["exact_resume"]
    big = {"model": {"w": torch.arange(5_000_000, dtype=torch.float32).reshape(1000, 5000)}, "run": {"step": 1}}
    written = save_state(tmp_path / "big", big)  # the default cap: 16 MiB
    assert all(f.stat().st_size <= MAX_FILE_BYTES for f in written) and len(written) == 3
    assert torch.equal(load_state(tmp_path / "big")["model"]["w"], big["model"]["w"])


@pytest.fixture(scope="module")
def regenerated(pretrained, corpus, tmp_path_factory):
    """Prompts from the pieces, continued by the tiny target in two slices (greedy and T = 0.7 in turn)."""
    root, tok = corpus
    *_, target = pretrained
    base = tmp_path_factory.mktemp("regen")
    pieces = sorted((root / "pieces").glob("train-*.u16.xz"))
    make_prompts(pieces, tok, count=12, prompt_tokens=8, seed=0, out=base / "prompts")
    cfg = RegenConfig(new_tokens=24, batch_size=8, chunk_prompts=4, max_piece_bytes=300)
    first = regen_slice(target, base / "prompts", base / "out1", cfg=cfg, max_prompts=8, device="cpu")
    second = regen_slice(target, base / "prompts", base / "rows", state_path=base / "out1" / "regen_state.json",
                         device="cpu")
    for f in (base / "out1").glob("regen-*"):
        shutil.copy(f, base / "rows")
    return base, first, second


def test_regeneration_writes_pieces_the_corpus_reader_reads(regenerated, pretrained, corpus):
    from blockspec.train.trainer import _plain_greedy

    base, first, second = regenerated
    assert first["prompts"] == [0, 8] and second["prompts"] == [8, 12] and second["prompts_left"] == 0
    names = first["pieces"] + second["pieces"]  # indices run on across slices; each piece under its cap
    assert len(first["pieces"]) >= 2 and names == [f"regen-{i:05d}.u16.xz" for i in range(len(names))]
    for name in names:
        assert len(load_piece(base / "rows" / name)) % 32 == 0 and (base / "rows" / name).stat().st_size <= 300
    rows = load_rows(base / "rows")
    prompts = load_rows(base / "prompts", "prompts").tokens
    assert rows.tokens.shape == (12, 32) and np.array_equal(rows.tokens[:, :8], prompts)
    assert len(load_split(base / "rows", "regen")) == 12 * 32
    mask = rows.loss_mask()
    assert not mask[:, :8].any() and mask.sum() == first["generated_tokens"] + second["generated_tokens"]
    state = json.loads((base / "rows" / "regen_state.json").read_text())
    assert state["next_prompt"] == 12 and state["pieces"] == len(names) and state["tokens"] == 12 * 32
    target, _ = load_target(pretrained[-1], "float32", "cpu")
    for i in (0, 2, 10):  # even prompts are greedy: the row is the target's plain greedy continuation
        n = rows.continuation_lengths()[i]
        assert rows.tokens[i, 8 : 8 + n].tolist() == _plain_greedy(target, prompts[i].tolist(), 24,
                                                                   {corpus[1].eos_token_id})[:n]


def test_drafter_stage_resumes_and_exports_the_best(regenerated, pretrained, tmp_path):
    from blockspec.drafters import load_dspark

    base, *_ = regenerated
    *_, target = pretrained
    cfg = DrafterStageConfig(train=dict(method="dspark", num_layers=1, block_size=4, markov_rank=8, max_len=32,
                                        batch_size=4, num_anchors=4, lr=3e-3),
                             epochs=4.0, eval_every_steps=2, eval_prompts=2, eval_new_tokens=8)
    whole = drafter_slice(target, base / "rows", tmp_path / "whole", cfg=cfg, max_steps=4, device="cpu",
                          max_file_bytes=CAP)
    first = drafter_slice(target, base / "rows", tmp_path / "sliced", cfg=cfg, max_steps=2, device="cpu",
                          max_file_bytes=CAP)
    second = drafter_slice(target, base / "rows", tmp_path / "sliced", max_steps=2, device="cpu", max_file_bytes=CAP)
    assert (first["to_step"], second["from_step"], second["to_step"]) == (2, 2, 4) and whole["total_steps"] == 12
    a, b = load_state(tmp_path / "whole"), load_state(tmp_path / "sliced")
    for name, t in a["drafter"].items():
        assert torch.equal(t, b["drafter"][name]), name
    assert [e["step"] for e in b["run"]["evals"]] == [2, 4] and b["run"]["best"]["step"] in (2, 4)
    assert second["exact_resume"] and b["run"]["evals"] == a["run"]["evals"]
    assert all(f.stat().st_size <= CAP for f in state_files(tmp_path / "sliced"))
    for f in state_files(tmp_path / "sliced", ["optimizer"])[1:]:  # the moments left on the machine
        f.unlink()
    third = drafter_slice(target, base / "rows", tmp_path / "sliced", max_steps=1, device="cpu", max_file_bytes=CAP)
    assert third["to_step"] == 5 and not third["exact_resume"]
    exported = export_best(tmp_path / "sliced", target, tmp_path / "dspark")
    drafter = load_dspark(exported, device="cpu", dtype="float32")
    assert drafter.block_size == 4 and drafter.has_confidence


def test_a_new_drafter_run_starts_from_an_export(regenerated, pretrained, tmp_path):
    """A run started from another run's export (`init`) holds its weights at step 0: its first evaluation
    (nothing trained yet) gives the exported drafter's per-position acceptance exactly, and it trains
    on from there. A deeper plan starts from the same drafts; an export of another shape is refused, naming
    the tensor. A plan reading more target layers also starts from the same drafts (the new taps' columns of
    fc at zero); one that drops a layer the export reads is refused."""
    from blockspec.drafters import load_dflash
    from blockspec.train.data import DataError

    base, *_ = regenerated
    *_, target = pretrained
    train = {"method": "dflash", "num_layers": 1, "block_size": 4, "max_len": 32, "batch_size": 4, "num_anchors": 4,
             "lr": 3e-3}
    cfg = DrafterStageConfig(train=train, epochs=4.0, eval_every_steps=3, eval_prompts=2, eval_new_tokens=8)
    drafter_slice(target, base / "rows", tmp_path / "first", cfg=cfg, max_steps=3, device="cpu")
    exported = export_best(tmp_path / "first", target, tmp_path / "export")
    source = load_state(tmp_path / "first", groups=["run"])["run"]
    warm = dataclasses.replace(cfg, init=str(exported))
    start = drafter_slice(target, base / "rows", tmp_path / "warm", cfg=warm, max_steps=0, device="cpu")
    best = next(e for e in source["evals"] if e["step"] == source["best"]["step"])
    assert start["to_step"] == 0 and start["evals"][0]["per_position"] == best["per_position"]
    state = load_state(tmp_path / "warm", groups=["run", "drafter"])
    assert state["run"]["config"]["init"] == str(exported)
    theirs = load_dflash(exported, device="cpu", dtype="float32").state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in state["drafter"].items())
    more = drafter_slice(target, base / "rows", tmp_path / "warm", max_steps=2, device="cpu")
    assert (more["from_step"], more["to_step"]) == (0, 2)
    # a deeper plan: the export's layer, then one that starts as the identity (its residual branches end in
    # zeroed products, the rest of it initialized to train): the export's function, loss for loss
    deeper = dataclasses.replace(warm, train=train | {"num_layers": 2})
    model, _ = load_target(target, "float32", "cpu")
    tokenizer = load_tokenizer(Path(target))
    g = torch.Generator().manual_seed(5)
    held = [Example(ids, [1] * len(ids)) for ids in torch.randint(3, 90, (4, 32), generator=g).tolist()]
    theirs_taps = list(load_dflash(exported, device="cpu", dtype="float32").config.target_layer_ids)
    wider = dataclasses.replace(warm, train=train | {"target_layer_ids": [-1, *theirs_taps, 1]})
    stages = {name: open_stage(model, tokenizer, base / "rows", tmp_path / name, plan, torch.device("cpu"))
              for name, plan in (("as-export", warm), ("deeper", deeper), ("wider", wider))}
    losses = [stage.trainer.evaluate(held)["loss"] for stage in stages.values()]
    assert losses[0] == losses[1] == losses[2]
    fc, h = stages["wider"].trainer.drafter.state_dict()["fc.weight"], model.config.hidden_size
    assert fc.shape[1] == h * (len(theirs_taps) + 2)
    assert torch.equal(fc[:, h:-h], theirs["fc.weight"]) and not fc[:, :h].any() and not fc[:, -h:].any()
    narrower = dataclasses.replace(warm, train=train | {"target_layer_ids": [1]})
    with pytest.raises(DataError, match=r"reads target layers \[0\]; the plan's taps \[1\] lack \[0\]"):
        drafter_slice(target, base / "rows", tmp_path / "narrower", cfg=narrower, max_steps=0, device="cpu")
    weights = stages["deeper"].trainer.drafter.state_dict()
    assert all(torch.equal(weights[name], t) for name, t in theirs.items())
    added = {name: t for name, t in weights.items() if name.startswith("layers.1.")}
    assert added and all(not t.any() for name, t in added.items() if "o_proj" in name or "down_proj" in name)
    assert added["layers.1.self_attn.qkv_proj.weight"].any()
    other = dataclasses.replace(warm, train=train | {"intermediate_size": 40})
    with pytest.raises(DataError, match=r"layers\.0\.mlp\.gate_up_proj\.weight is \(.*\), the planned.*\(80, "):
        drafter_slice(target, base / "rows", tmp_path / "other", cfg=other, max_steps=0, device="cpu")


def test_assemble_writes_the_pair_with_cards_read_from_the_run(regenerated, pretrained, corpus, tmp_path):
    """The shipped directory: the three exports, each with a card whose figures are the run's own records
    (perplexity, licenses, best acceptance), the drafters' recorded acceptance, and metrics.json; a run
    without its exports is refused with the missing path."""
    from safetensors import safe_open

    from blockspec.drafters import load_drafter
    from blockspec.drafters.formats import TARGET_COPIES
    from blockspec.train.recipes.flagship_cards import assemble

    _, tok = corpus
    rows, _, second = regenerated
    pbase, *_, target = pretrained
    run = tmp_path / "run"
    (run / "corpus").mkdir(parents=True)
    manifest = {"splits": {"train": {"files": 40, "tokens": 30000}},
                "archives": [{"name": "python-stdlib"}, {"name": "demo-project"}],
                "stdlib": {"python": "3.11.7"}, "heldout": {"packages": ["json", "asyncio", "email"]},
                "dedup": {"duplicates_dropped": 3},
                "tokenizer": {"vocab_size": len(tok), "special_tokens": ["<|endoftext|>", "<|mask|>"]},
                "licenses": {"MIT": ["demo-project"], "PSF-2.0": ["python-stdlib"]}}
    (run / "corpus" / "manifest.json").write_text(json.dumps(manifest))
    shutil.copytree(pbase / "whole", run / "target-state")
    (run / "regen").mkdir()
    (run / "regen" / "regen_metrics.json").write_text(json.dumps(second))
    with pytest.raises(FileNotFoundError, match="run/target: no export"):
        assemble(run, tmp_path / "pair")
    shutil.copytree(target, run / "target")
    train = dict(num_layers=1, max_len=32, batch_size=4, num_anchors=4, lr=3e-3)
    states = {"dflash": "dflash-state", "dspark": "dspark-longer"}  # a state not named METHOD-state, as --states
    for method, extra in (("dflash", dict(block_size=4)), ("dspark", dict(block_size=4, markov_rank=8))):
        cfg = DrafterStageConfig(train=dict(method=method, **train, **extra), epochs=1.0, eval_every_steps=2,
                                 eval_prompts=2, eval_new_tokens=8)
        drafter_slice(target, rows / "rows", run / states[method], cfg=cfg, max_steps=2, device="cpu")
        export_best(run / states[method], target, run / method)
    assets = assemble(run, tmp_path / "pair", {"dspark": "dspark-longer"})
    pair = tmp_path / "pair"
    last = load_state(run / "target-state", groups=["run"])["run"]["history"][-1]
    card = (pair / "target" / "README.md").read_text()
    assert f"validation projects {last['valid_perplexity']:.2f}" in card and "MIT: demo-project" in card
    assert "1 pinned" in card and (pair / "target" / "corpus_manifest.json").is_file()
    for method in ("dflash", "dspark"):
        best = load_state(run / states[method], groups=["run"])["run"]["best"]
        assert f"{best['acceptance']:.2f} tokens per verify step" in (pair / method / "README.md").read_text()
        assert load_drafter(method, pair / method, device="cpu").recorded_acceptance is not None
    with safe_open(str(pair / "target" / "model.safetensors"), "pt") as f:
        params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    assert assets["target"]["parameters"] == params
    assert json.loads((pair / "metrics.json").read_text())["assets"] == assets
    with safe_open(str(run / "dspark" / "model.safetensors"), "pt") as f:
        assert set(TARGET_COPIES) <= set(f.keys())  # the export is the reference's format
    with safe_open(str(pair / "dspark" / "model.safetensors"), "pt") as f:
        assert not set(TARGET_COPIES) & set(f.keys())  # the shipped one takes the target's
    assert assets["dspark"]["bytes"] == (pair / "dspark" / "model.safetensors").stat().st_size
    # --fp8-target: the same pair with the target's FP8 twin, fewer bytes, the same parameters, a card that says so
    fp8_assets = assemble(run, tmp_path / "pair8", {"dspark": "dspark-longer"}, fp8_target=True)
    config = json.loads((tmp_path / "pair8" / "target" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert fp8_assets["target"]["parameters"] == assets["target"]["parameters"]
    assert fp8_assets["target"]["bytes"] < assets["target"]["bytes"]
    assert "FP8: the decoder layers' products in e4m3" in (tmp_path / "pair8" / "target" / "README.md").read_text()
    assert fp8_assets["dspark"] == assets["dspark"]

    # a drafter continued from the shipped one replaces it; the card and metrics.json keep both runs
    from blockspec.train.recipes.flagship_cards import continue_drafter

    with pytest.raises(ValueError, match="not a continued run"):
        continue_drafter(pair, "dflash", run / "dflash-state", 999)
    first = json.loads((pair / "metrics.json").read_text())["drafters"]["dflash"]
    cfg = DrafterStageConfig(train=dict(method="dflash", block_size=4, **train), epochs=1.0, eval_every_steps=2,
                             eval_prompts=2, eval_new_tokens=8, init=str(pair / "dflash"))
    drafter_slice(pair / "target", rows / "rows", tmp_path / "warm", cfg=cfg, max_steps=2, device="cpu")
    best = continue_drafter(pair, "dflash", tmp_path / "warm", 4321)
    rec = json.loads((pair / "metrics.json").read_text())
    assert rec["drafters"]["dflash"]["best"] == first["best"] and rec["drafters"]["dflash"]["continued"]["best"] == best
    card = (pair / "dflash" / "README.md").read_text()
    assert "4,321 more generated tokens" in card and f"{best['acceptance']:.2f} tokens per verify step" in card
    assert load_drafter("dflash", pair / "dflash", device="cpu").recorded_acceptance == tuple(best["per_position"])


def test_asset_sizes_price_the_files_the_pair_ships(tmp_path):
    """`shapes`' asset column for the shipped shape: the shipped target's file, and with --fp8-target the FP8
    checkpoint `blockspec quantize` writes from it (each within 1 %: the files' headers)."""
    from blockspec.assets import embedded
    from blockspec.models.fp8_export import write_fp8_checkpoint
    from blockspec.train.recipes.flagship import SHAPE, asset_bytes

    target = Path(embedded("default"))
    tokenizer = (target / "tokenizer.json").stat().st_size
    bf16, fp8 = asset_bytes(SHAPE, tokenizer)["target"], asset_bytes(SHAPE, tokenizer, fp8_target=True)["target"]
    shipped = (target / "model.safetensors").stat().st_size
    written = (write_fp8_checkpoint(target, tmp_path / "fp8").out / "model.safetensors").stat().st_size
    assert abs(bf16 - shipped) < 0.01 * shipped and abs(fp8 - written) < 0.01 * written and fp8 < 0.75 * bf16


def test_a_flagship_shape_brings_drafters_that_fit_it(monkeypatch):
    """FLAGSHIP_SHAPE picks another candidate target, with drafters 3 x its hidden wide and z-lab's uniform taps
    over its layers; the default plan's drafters are the shipped ones' shape; an unknown name is refused by name."""
    from blockspec.train.data import DataError
    from blockspec.train.recipes import flagship

    shipped = json.loads((Path(flagship.__file__).parents[2] / "assets/default/dflash/config.json").read_text())
    dflash = flagship.active_plan().drafters["dflash"].train
    assert dflash["target_layer_ids"] == shipped["dflash_config"]["target_layer_ids"]
    assert dflash["intermediate_size"] == shipped["intermediate_size"]
    monkeypatch.setenv("FLAGSHIP_SHAPE", "h320-l8-i1280")
    plan = flagship.active_plan()
    assert plan.pretrain.shape == flagship.CANDIDATES["h320-l8-i1280"]
    for stage in plan.drafters.values():
        assert stage.train["intermediate_size"] == 960 and stage.train["target_layer_ids"] == [1, 2, 4, 5]
    monkeypatch.setenv("FLAGSHIP_SHAPE", "h999")
    with pytest.raises(DataError, match="'h999' is not a candidate; candidates: h256-l6-i1024"):
        flagship.active_plan()


def test_a_target_call_refuses_weights_it_could_not_return(monkeypatch, tmp_path, capsys):
    """A shape whose fp32 weights exceed a call's return is refused before any step when told to return them (the
    run would otherwise train for minutes and then fail); the shipped shape's weights fit."""
    from blockspec.train.data import DataError
    from blockspec.train.recipes import flagship

    flagship.check_weights_return(flagship.SHAPE)
    monkeypatch.setenv("FLAGSHIP_SHAPE", "h320-l8-i1280")
    args = ["target", "--pieces", str(tmp_path / "none"), "--state", str(tmp_path / "state"), "--minutes", "1",
            "--out", str(tmp_path / "out")]
    assert flagship.main(args) == 2
    assert "fp32 weights are 66.9 MiB, more than a call returns" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()
    with pytest.raises(DataError, match="66.9 MiB"):
        flagship.check_weights_return(flagship.CANDIDATES["h320-l8-i1280"])
