"""Training side: data and masks, tokenizer, target-LM export, drafter training forward == inference, resume."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
import re

import pytest
import torch
import transformers

from blockspec.config import ConfigError

from blockspec.models.kv_cache import dense_causal_meta
from blockspec.models.loader import load_target
from blockspec.drafters import DFlashDraft, DSparkDraft, load_dflash, load_dspark
from blockspec.train.data import (
    HELDOUT_PACKAGES,
    SPECIAL_TOKENS,
    Batches,
    DataError,
    Example,
    jsonl_examples,
    pack_documents,
    read_texts,
    record_example,
    save_tokenizer,
    stdlib_split,
    text_examples,
    train_tokenizer,
)
from blockspec.train.target_lm import LMTrainConfig, TargetShape, new_target, perplexity, save_hf_target, train_target
from blockspec.train.trainer import (
    DrafterTrainConfig,
    DrafterTrainer,
    block_attention_masks,
    build_drafter,
    drafter_loss,
    greedy_acceptance,
    markov_latents,
    sample_anchors,
    target_forward,
    target_taps,
    train_block_hidden,
    train_drafter,
)
from factories import save_tiny

SAMPLE = "def f(x):\n\treturn x  # héllo 中文 \r\n    \n" + "class A:\n    pass\n"



@pytest.fixture(scope="module")
def split():
    return stdlib_split()


@pytest.fixture(scope="module")
def tokenizer(split, tmp_path_factory):
    texts = read_texts(split.train[:25])
    tok = train_tokenizer(texts, vocab_size=600)
    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, path)
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("target"), "qwen3", seed=5, vocab=96, hidden=64, layers=4)
    target, _ = load_target(path, dtype="float32", device="cpu")
    return target, path


# ---------------------------------------------------------------- data
def test_stdlib_split_holds_out_packages_and_tests(split):
    assert split.train == sorted(split.train) and split.heldout
    for p in split.train:
        rel = p.relative_to(split.root).parts
        assert rel[0] not in HELDOUT_PACKAGES and rel[0] not in {f"{h}.py" for h in HELDOUT_PACKAGES}
        assert not {"test", "tests", "site-packages"} & set(rel[:-1])
    assert {p.relative_to(split.root).parts[0] for p in split.heldout} <= set(HELDOUT_PACKAGES)
    assert stdlib_split().train == split.train


def test_tokenizer_round_trip_and_specials(tokenizer, split):
    assert [tokenizer.convert_ids_to_tokens(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 1 and tokenizer.mask_token_id == 2
    for text in [SAMPLE, *read_texts(split.heldout[:3])]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.chat_template


def test_chat_and_response_masks(tokenizer):
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo yo"},
                           {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]}
    ex = record_example(record, tokenizer, 512)
    supervised = tokenizer.decode([t for t, m in zip(ex.input_ids, ex.loss_mask) if m])
    assert supervised == "yo yo<|im_end|>\nok<|im_end|>\n"
    assert tokenizer.decode(ex.input_ids) == tokenizer.apply_chat_template(record["messages"], tokenize=False)
    ex2 = record_example({"prompt": "say", "response": "x = 1"}, tokenizer, 512)
    assert tokenizer.decode([t for t, m in zip(ex2.input_ids, ex2.loss_mask) if m]) == "x = 1<|im_end|>\n"
    assert record_example({"prompt": "say", "response": "x = 1"}, tokenizer, 3) is None  # truncated away
    tokenizer.chat_template, saved = None, tokenizer.chat_template
    try:
        ex3 = record_example({"prompt": "say ", "response": "x = 1"}, tokenizer, 512)
    finally:
        tokenizer.chat_template = saved
    assert tokenizer.decode([t for t, m in zip(ex3.input_ids, ex3.loss_mask) if m]) == "x = 1<|endoftext|>"


@pytest.mark.parametrize("record, says", [
    ({"prompt": 5, "response": "x y"}, "field prompt must be a string, got a number"),
    ({"prompt": "x", "response": ["y"]}, "field response must be a string, got an array"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
     r"field messages\[1\].content must be a string, got null"),
    ({"messages": [{"role": 1, "content": "hi"}]}, r"field messages\[0\].role must be a string, got a number"),
    (7, "a record must be a JSON object, got a number")])
def test_records_with_non_text_fields_are_refused_by_file_line_and_field(tokenizer, tmp_path, record, says):
    """A number or a list where text belongs would be rendered by the chat template as its repr and trained
    on: refused in one line naming the file, the line and the field (a record that is no object too)."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "say", "response": "x = 1"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:2: {says}$"):
        jsonl_examples(path, tokenizer, 512)


def test_text_records_are_documents_packed_with_full_loss(tokenizer, tmp_path):
    """A jsonl of {"text"} records (as text datasets ship) trains as text files do: the documents packed with
    full loss, after the file's conversations; a text that is not a string is refused by file, line and field."""
    docs = ["def f(x):\n    return x + 1\n", "import os\nprint(os.sep)\n"]
    chat = {"prompt": "say", "response": "x = 1"}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"text": docs[0]}, chat, {"text": docs[1]})) + "\n")
    got = jsonl_examples(path, tokenizer, 512)
    assert got == [record_example(chat, tokenizer, 512), *text_examples(docs, tokenizer, 512)]
    eos = tokenizer.eos_token
    assert all(got[-1].loss_mask) and tokenizer.decode(got[-1].input_ids) == eos.join(docs) + eos
    path.write_text(json.dumps({"text": ["x"]}) + "\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:1: field text must be a string, got an array$"):
        jsonl_examples(path, tokenizer, 512)
    path.write_text(json.dumps({"txt": "x"}) + "\n")
    with pytest.raises(DataError, match="needs 'messages', both 'prompt' and 'response', or 'text'; has \\['txt'\\]"):
        jsonl_examples(path, tokenizer, 512)


def test_content_parts_train_on_the_text_a_request_of_them_is_served(tokenizer, tmp_path):
    """OpenAI content parts in a record's messages are joined as inference joins them (`inputs.text_content`):
    the same example as the joined string; a part that is not text is refused by file, line and part."""
    parts = [{"type": "text", "text": "say"}, {"type": "text", "text": "it"}]
    listed = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "x = 1"}]}
    joined = {"messages": [{"role": "user", "content": "say\nit"}, {"role": "assistant", "content": "x = 1"}]}
    assert record_example(listed, tokenizer, 512) == record_example(joined, tokenizer, 512)
    path = tmp_path / "d.jsonl"
    listed["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    path.write_text(json.dumps(joined) + "\n" + json.dumps(listed) + "\n")
    with pytest.raises(DataError, match=f"^{re.escape(str(path))}:2: messages\\[0\\], content part 0: 'image_url'"):
        jsonl_examples(path, tokenizer, 512)


def test_text_packing_and_batches():
    chunks = pack_documents([[5, 6, 7], [8, 9]], max_len=4, eos_id=0)
    assert [c.input_ids for c in chunks] == [[5, 6, 7, 0], [8, 9, 0]]
    assert all(all(c.loss_mask) for c in chunks)
    examples = [Example([i, i + 1, i + 2], [1, 1, 1]) for i in range(10)]
    a = Batches(examples, 3, pad_id=1, seed=4)
    seen = [next(a)[0] for _ in range(5)]
    b = Batches(examples, 3, pad_id=1, seed=4)
    for _ in range(2):
        next(b)
    c = Batches(examples, 3, pad_id=1, seed=4)
    c.load_state_dict(b.state_dict())
    assert all(torch.equal(next(c)[0], s) for s in seen[2:])


def test_anchor_sampling_only_on_supervised_pairs():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0]])
    anchors, valid = sample_anchors(mask, 8, torch.Generator().manual_seed(0))
    assert anchors.shape == (2, 3)
    for row, (a, v) in enumerate(zip(anchors.tolist(), valid.tolist())):
        good = [p for p, ok in zip(a, v) if ok]
        assert good == sorted({2, 3, 6} if row == 0 else {1})
        assert a == sorted(a)


# ---------------------------------------------------------------- target LM
def test_target_lm_trains_and_exports_hf(tokenizer, split, tmp_path):
    examples = text_examples(read_texts(split.train[:15]), tokenizer, 64)
    held = text_examples(read_texts(split.heldout[:2]), tokenizer, 64)[:8]
    shape = TargetShape(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                        num_kv_heads=1, head_dim=32, max_position_embeddings=256)
    model = new_target(shape.model_config(tokenizer.eos_token_id), seed=0)
    before = perplexity(model, held, tokenizer.pad_token_id)
    metrics = train_target(model, examples, held, LMTrainConfig(seq_len=64, batch_size=8, max_steps=30, lr=8e-3,
                                                                device="cpu", progress=False), tokenizer.pad_token_id)
    assert metrics["heldout_perplexity"] < 0.6 * before
    out = save_hf_target(model, tmp_path / "lm", tokenizer, dtype="float32")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    ours, _ = load_target(out, dtype="float32", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([held[0].input_ids[:40]])
    hidden, _ = ours(ids, dense_causal_meta(1, 40, "cpu"), None)
    with torch.no_grad():
        assert (ours.compute_logits(hidden) - hf(ids).logits).abs().max() < 1e-4
    assert transformers.AutoTokenizer.from_pretrained(str(out)).decode(ids[0].tolist()) == tokenizer.decode(ids[0])


# ---------------------------------------------------------------- drafter forward == inference
DRAFTERS = [("dflash", "vanilla"), ("dspark", "vanilla"), ("dspark", "gated"), ("dspark", "rnn"),
            ("dflash", "swa-query"), ("dflash", "swa-anchor")]


@pytest.mark.parametrize("method,head", DRAFTERS, ids=[f"{m}-{h}" for m, h in DRAFTERS])
def test_training_forward_equals_inference(tiny_target, method, head):
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method=method, num_layers=2, block_size=5, markov_rank=8,
                             markov_head_type=head if method == "dspark" else "vanilla", device="cpu")
    drafter = build_drafter(cfg, target.config, mask_token_id=95, seed=1)
    if head.startswith("swa"):  # sliding-window layers, one causal in-block: z-lab and speculators rules
        swa = dataclasses.replace(drafter.config, layer_types=("sliding_attention", "full_attention"),
                                  sliding_window=4, causal=(True, False), window_mode=head.split("-")[1])
        state = drafter.state_dict()
        drafter = DFlashDraft(swa)
        drafter.load_state_dict(state)
    drafter = drafter.cast("cpu", torch.float32).eval()
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[0, 7, 12], [3, 5, 18]])
    with torch.no_grad():
        _, feats = target_forward(target, ids, drafter.target_layer_ids)
        train_h = train_block_hidden(drafter, ids, feats, anchors, target.embed)
        for b in range(2):
            for n, p in enumerate(anchors[b].tolist()):
                cache = drafter.new_cache(1, 64)
                drafter.append_context(cache, [0], [0], [p], feats[b : b + 1, :p])
                infer_h = drafter.block_hidden(cache, [0], [p], ids[b, p : p + 1], target.embed)
                assert (infer_h[0] - train_h[b, n]).abs().max() < 1e-5
                train_logits = drafter.logits(drafter.slot_hidden(train_h[b, n][None]), target)
                infer_logits = drafter.logits(drafter.slot_hidden(infer_h), target)
                assert (train_logits - infer_logits).abs().max() < 1e-4
        if isinstance(drafter, DSparkDraft):  # teacher-forced Markov latents == the sequential head
            slot_h = drafter.slot_hidden(train_h[0])[None]  # [1, N, K, H]
            prev = ids[0, anchors[0][:, None] + torch.arange(5)][None]
            latent = markov_latents(drafter, slot_h, prev)
            state = None
            for j in range(5):
                bias, state = drafter.markov_step(j, slot_h[0, :, j], prev[0, :, j], state)
                assert (drafter.markov_head.markov_w2(latent[0, :, j]).float() - bias).abs().max() < 1e-5


def test_block_mask_semantics(tiny_target):
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method="dflash", num_layers=1, block_size=3, device="cpu")
    drafter = build_drafter(cfg, target.config, mask_token_id=95)
    mask = block_attention_masks(drafter.config, torch.tensor([[2, 5]]), seq_len=8)[0][0, 0]
    assert mask.shape == (6, 8 + 6)
    assert mask[0, :8].tolist() == [True, True] + [False] * 6  # context strictly before anchor 2
    assert mask[4, :8].tolist() == [True] * 5 + [False] * 3
    assert mask[0, 8:].tolist() == [True] * 3 + [False] * 3  # own block both ways, no other block
    assert mask[5, 8:].tolist() == [False] * 3 + [True] * 3


# ---------------------------------------------------------------- training runs
def _pattern_examples(n: int, length: int, seed: int) -> list[Example]:
    """Learnable sequences: counting mod 90 from a random start (the block is a function of the anchor)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = int(torch.randint(0, 90, (1,), generator=g))
        ids = [(start + i) % 90 for i in range(length)]
        out.append(Example(ids, [0] * 4 + [1] * (length - 4)))
    return out


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_drafter_training_lowers_loss_and_exports(tiny_target, method, tmp_path):
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method=method, num_layers=1, block_size=4, markov_rank=16, max_len=32, batch_size=8,
                             num_anchors=8, lr=1e-2, warmup_frac=0.0, max_steps=30, device="cpu", progress=False,
                             eval_batches=2,
                             mask_token_id=95)
    data = _pattern_examples(48, 32, seed=1)
    result = train_drafter(target, data, cfg, eval_data=_pattern_examples(8, 32, seed=2), out_dir=tmp_path / method)
    hist = result.history
    assert hist[-1]["loss"] < 0.85 * hist[0]["loss"], hist
    assert result.metrics["heldout"]["tau_estimate"] >= 1.0
    loaded = (load_dflash if method == "dflash" else load_dspark)(tmp_path / method, device="cpu", dtype="float32")
    loaded.check_target(target.config)
    assert type(loaded) is type(result.drafter) and loaded.block_size == 4
    assert loaded.mask_token_id == result.drafter.mask_token_id
    for name, p in result.drafter.named_parameters():  # exported in bf16
        q = dict(loaded.named_parameters())[name]
        assert torch.allclose(p.float(), q.float(), atol=1e-2, rtol=1e-2)
    stats = greedy_acceptance(target, loaded, [data[0].input_ids[:6]], max_new_tokens=12, eos_ids=[1])
    assert stats["matches_plain_greedy"] and stats["mean_acceptance_length"] >= 1.0
    tuned = DrafterTrainConfig(method=method, init_from=str(tmp_path / method), max_len=32, batch_size=8,
                               max_steps=2, device="cpu", progress=False)
    again = train_drafter(target, data, tuned, eval_data=data[:4], out_dir=tmp_path / "tuned")
    assert again.drafter.config == loaded.config and (tmp_path / "tuned" / "model.safetensors").is_file()
    # a shape the checkpoint does not have is refused by name (it was ignored); one it has may be given
    clash = dataclasses.replace(tuned, num_layers=3, block_size=4, markov_rank=32)
    with pytest.raises(ConfigError, match=r"drop or match --num-layers 3 \(the checkpoint's: 1\)") as err:
        train_drafter(target, data, clash, eval_data=data[:4])
    assert ("--markov-rank 32 (the checkpoint's: 16)" in str(err.value)) == (method == "dspark")
    assert "--block-size" not in str(err.value)


def test_resume_gives_the_same_next_step(tiny_target, tmp_path):
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method="dspark", num_layers=1, block_size=3, markov_rank=8, max_len=24, batch_size=4,
                             num_anchors=4, max_steps=4, device="cpu", progress=False)
    data = _pattern_examples(10, 24, seed=3)
    a = DrafterTrainer(target, data, cfg, mask_token_id=95, pad_id=0)
    for _ in range(2):
        a.step(4)
    a.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(123)  # disturb global RNG: the restore must not depend on it
    expected = a.step(4)
    b = DrafterTrainer(target, data, cfg, mask_token_id=95, pad_id=0)
    b.load_checkpoint(tmp_path / "ckpt")
    got = b.step(4)
    assert b.step_num == a.step_num == 3
    assert float(got.loss.detach()) == float(expected.loss.detach())
    for (n, p), q in zip(a.drafter.named_parameters(), b.drafter.parameters()):
        assert torch.equal(p, q), n


def test_a_resume_that_would_change_the_restored_optimiser_or_data_order_is_refused(tiny_target, tmp_path):
    """The optimiser, schedule and data order come back from the checkpoint, so a new --lr (or weight decay,
    batch size, seed, ...) would be ignored while the new checkpoint recorded it; it is refused by name."""
    target, _ = tiny_target
    kw = dict(method="dspark", num_layers=1, block_size=3, markov_rank=8, max_len=24, batch_size=4, num_anchors=4,
              max_steps=4, device="cpu", progress=False)
    data = _pattern_examples(10, 24, seed=3)
    a = DrafterTrainer(target, data, DrafterTrainConfig(**kw), mask_token_id=95, pad_id=0)
    a.step(4)
    a.save_checkpoint(tmp_path / "ckpt")
    b = DrafterTrainer(target, data, DrafterTrainConfig(**kw, lr=0.05, weight_decay=0.3), mask_token_id=95, pad_id=0)
    with pytest.raises(ConfigError, match=r"a resumed run keeps its checkpoint's --lr .* \(this run: 0.05\); "
                                          r"--weight-decay 0.0 \(this run: 0.3\)"):
        b.load_checkpoint(tmp_path / "ckpt")
    DrafterTrainer(target, data, DrafterTrainConfig(**{**kw, "max_steps": 8}), mask_token_id=95,
                   pad_id=0).load_checkpoint(tmp_path / "ckpt")  # more steps: the one change a resume takes


def test_train_refuses_an_export_over_a_model_and_reads_jsonl_records_wherever_they_are(tiny_target, tmp_path,
                                                                                          capsys):
    """--out that is the target's directory, or holds another model, would have the export overwrite it; a
    directory or glob of .jsonl files is read as records (it used to be packed as text, JSON syntax and all), and
    a .json file is refused. Shapes that cannot work are one line, not a tensor error."""
    from blockspec.cli import main
    from blockspec.train.data import DataError, load_examples
    from factories import save_tiny_tokenizer

    _, target_dir = tiny_target
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    for out in (target_dir, tmp_path / "other"):
        if out != target_dir:
            out.mkdir()
            (out / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
        assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "the export would overwrite the target" in err or "holds a model (Qwen3ForCausalLM)" in err, err
    tok_dir = tmp_path / "tok"
    save_tiny_tokenizer(tok_dir)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    records = tmp_path / "records"
    records.mkdir()
    line = '{"prompt": "ab", "response": "cd"}\n'
    for name in ("a.jsonl", "b.jsonl"):
        (records / name).write_text(line * 3)
    one = load_examples(records / "a.jsonl", tok, 32)
    both = load_examples(records, tok, 32)
    assert len(both) == 2 * len(one) and [e.input_ids for e in both[: len(one)]] == [e.input_ids for e in one]
    assert len(load_examples(str(records / "*.jsonl"), tok, 32)) == len(both)
    (records / "c.json").write_text("[" + line.strip() + "]")
    with pytest.raises(DataError, match=r"c.json: a .json file is not read .* give records as .jsonl"):
        load_examples(records, tok, 32)
    same_vocab = save_tiny(tmp_path / "t", "qwen3", seed=5, vocab=len(tok) + 1, hidden=64, layers=4)  # + a mask row
    for target, flags, says in (
            (same_vocab, ["--num-heads", "3"], "--num-heads 3 must divide the hidden size 64"),
            (same_vocab, ["--num-kv-heads", "3"], "--num-kv-heads 3 must divide --num-heads"),
            (target_dir, [], f"the tokenizer has {len(tok)} tokens and the target's embedding 96 rows")):
        assert main(["train", "--target", str(target), "--data", str(records / "a.jsonl"), "--tokenizer",
                     str(tok_dir), "--out", str(tmp_path / "o"), "--max-steps", "1", "--no-progress", *flags]) == 2
        assert says in capsys.readouterr().err
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--tokenizer", str(tmp_path / "none"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_data_that_cannot_train_says_why(tmp_path):
    """A jsonl that is not UTF-8 names its file (it was a traceback); text files that are all empty or not
    UTF-8 say so (it was "no training examples"); a single example trains with nothing held out (the
    held-out split took it)."""
    from blockspec.train.data import DataError, load_examples, split_examples

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xff\xfe{"text": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: not UTF-8 text \(byte 0"):
        load_examples(bad, None, 32)
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_bytes(b"\xff\xfe")
    (texts / "b.py").write_text("")
    with pytest.raises(DataError, match=r"no text to train on \(2 file\(s\), each empty or not UTF-8\)"):
        load_examples(texts, None, 32)
    assert split_examples(["only"], 0.02, 0) == (["only"], [])
    train, held = split_examples(list(range(10)), 0.02, 0)
    assert len(train) == 9 and len(held) == 1


def test_init_from_names_its_family_and_takes_default(tiny_target, tmp_path, capsys):
    """--init-from a DSpark drafter without --method dspark names the flag; 'default' is the embedded
    drafter of --method (it was read as a directory named default)."""
    from blockspec.cli import main

    _, target_dir = tiny_target
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    dspark = str(Path(__file__).parent / "fixtures" / "drafters" / "dspark_vanilla")
    assert main(["train", "--target", str(target_dir), "--data", str(data), "--out", str(tmp_path / "o"),
                 "--init-from", dspark]) == 2
    assert f"--init-from {dspark} is a dspark drafter: give --method dspark" in capsys.readouterr().err
    data.write_text('{"text": "def f(x):\\n    return x + 1\\n"}\n' * 8)
    assert main(["train", "--target", "default", "--data", str(data), "--out", str(tmp_path / "o"), "--init-from",
                 "default", "--max-steps", "1", "--no-progress", "--eval-frac", "0", "--acceptance-prompts", "0"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["block_size"] == 16  # the embedded DFlash's


def test_checkpoint_is_safetensors_and_a_weights_only_state(tiny_target, tmp_path):
    """The weights load with safetensors alone and the rest with torch.load(weights_only=True): no pickled
    objects; the state names its format version, and a weights file from another step is refused."""
    from safetensors.torch import load_file

    target, _ = tiny_target
    cfg = DrafterTrainConfig(method="dspark", num_layers=1, block_size=3, markov_rank=8, max_len=24, batch_size=4,
                             num_anchors=4, max_steps=4, device="cpu", progress=False)
    trainer = DrafterTrainer(target, _pattern_examples(10, 24, seed=3), cfg, mask_token_id=95, pad_id=0)
    trainer.step(4)
    ckpt = trainer.save_checkpoint(tmp_path / "ckpt")
    weights = load_file(str(ckpt / "drafter.safetensors"))
    assert all(torch.equal(weights[n], p) for n, p in trainer.drafter.named_parameters() if n in weights)
    state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    assert state["format_version"] == 1 and state["step"] == 1 and state["optimizer"]["state"]
    assert state["schedule"]["total"] == 4 and state["batches"] == trainer.batches.state_dict()
    trainer.step(4)
    (ckpt / "trainer_state.pt").rename(tmp_path / "state_step1.pt")
    trainer.save_checkpoint(ckpt)
    (tmp_path / "state_step1.pt").replace(ckpt / "trainer_state.pt")  # a save cut between its two files
    with pytest.raises(ConfigError, match="from step 2"):
        DrafterTrainer(target, _pattern_examples(10, 24, seed=3), cfg, mask_token_id=95, pad_id=0).load_checkpoint(ckpt)
    # a truncated state or weights file is named in one line (a reader's traceback before)
    fresh = DrafterTrainer(target, _pattern_examples(10, 24, seed=3), cfg, mask_token_id=95, pad_id=0)
    for name, says in (("trainer_state.pt", "not a readable training state"),
                       ("drafter.safetensors", "not a readable safetensors file")):
        trainer.save_checkpoint(ckpt)
        (ckpt / name).write_bytes((ckpt / name).read_bytes()[:40])
        with pytest.raises(ConfigError, match=f"{name}: {says}"):
            fresh.load_checkpoint(ckpt)


def _checkpointed_run(tiny_target, ckpt, max_steps: int, resume: bool):
    """A small dflash run on the tiny target that checkpoints to `ckpt` (and with `resume`, continues it)."""
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method="dflash", num_layers=1, block_size=3, max_len=24, batch_size=4, num_anchors=4,
                             max_steps=max_steps, checkpoint_dir=str(ckpt), resume=resume, mask_token_id=95,
                             device="cpu", progress=False)
    return train_drafter(target, _pattern_examples(12, 24, seed=3), cfg, tokenizer=None, eval_data=[], out_dir=None)


def test_resume_with_more_steps_trains_the_rest(tiny_target, tmp_path):
    """A run of 3 steps, resumed with --max-steps 6, trains steps 4-6 and says so; resumed again with the
    same --max-steps it has nothing left to train and says that instead of exporting the same drafter."""

    def run(max_steps: int, resume: bool):
        return _checkpointed_run(tiny_target, tmp_path / "ckpt", max_steps, resume)

    first = run(3, resume=False)
    assert first.metrics["steps"] == 3
    before = {n: p.clone() for n, p in first.drafter.named_parameters()}
    second = run(6, resume=True)
    assert second.metrics["steps"] == 6
    assert second.metrics["resumed_from_step"] == 3 and second.metrics["steps_this_run"] == 3
    assert any(not torch.equal(before[n], p) for n, p in second.drafter.named_parameters())
    with pytest.raises(ConfigError, match="at step 6 and --max-steps is 6: nothing left to train"):
        run(6, resume=True)


def test_a_checkpoint_is_resumed_or_refused_never_trained_over(tiny_target, tmp_path, capsys):
    """--resume starts a new run where --checkpoint-dir holds no checkpoint yet (one command starts and restarts
    a run) and continues a whole one; a checkpoint without --resume, or one missing its trainer state, is
    refused in one line before any work, so no run from step 0 overwrites its weights."""
    from blockspec.cli import main

    ckpt = tmp_path / "ckpt"
    assert _checkpointed_run(tiny_target, ckpt, 2, resume=True).metrics["resumed_from_step"] == 0
    with pytest.raises(ConfigError, match=f"--checkpoint-dir {re.escape(str(ckpt))} holds a checkpoint .* --resume"):
        _checkpointed_run(tiny_target, ckpt, 4, resume=False)
    (ckpt / "trainer_state.pt").unlink()
    weights = (ckpt / "drafter.safetensors").read_bytes()
    says = f"--resume: {ckpt} has drafter.safetensors but no trainer_state.pt"
    with pytest.raises(ConfigError, match=re.escape(says)):
        _checkpointed_run(tiny_target, ckpt, 4, resume=True)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "x", "response": "y"}\n')
    capsys.readouterr()
    assert main(["train", "--target", str(tmp_path / "no-target"), "--data", str(data), "--out", str(tmp_path / "out"),
                 "--checkpoint-dir", str(ckpt), "--resume"]) == 2  # refused before the target loads
    err = capsys.readouterr().err
    assert err.startswith(f"error: {says}") and err.count("\n") == 1
    assert (ckpt / "drafter.safetensors").read_bytes() == weights
    with pytest.raises(ConfigError, match="--resume needs --checkpoint-dir"):
        DrafterTrainConfig(resume=True)


def test_train_takes_default_as_the_embedded_target(tmp_path, monkeypatch):
    """`--target default` names the embedded target, as `serve default` and `bench --model default` do."""
    import blockspec.train.trainer as trainer
    from blockspec.cli import main
    from blockspec.assets import PAIR

    seen = []

    def stop(target, *rest):
        seen.append(target)
        raise DataError("stopped here")

    monkeypatch.setattr(trainer, "train_drafter", stop)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x = 1"}\n')
    for name, want in (("default", str(PAIR / "target")), ("org/name", "org/name")):
        assert main(["train", "--target", name, "--data", str(data), "--out", str(tmp_path / "out")]) == 2
        assert seen[-1] == want


def test_num_target_features_is_given_or_refused(tiny_target):
    """Any count up to all but the target's last layer is tapped as asked (4 layers: 1 to 3); a larger one,
    lowered, would train a drafter on fewer layers than asked for, so it is refused naming the flag and the
    range. None takes 3, or all but the last layer of a smaller target."""
    target, _ = tiny_target
    for n in (1, 2, 3):
        cfg = DrafterTrainConfig(method="dflash", num_layers=1, block_size=3, num_target_features=n)
        assert len(build_drafter(cfg, target.config, 95).target_layer_ids) == n
    with pytest.raises(ConfigError, match=r"^--num-target-features must be an integer in \[1, 3\] .* got 4$"):
        build_drafter(DrafterTrainConfig(method="dflash", num_target_features=4), target.config, 95)
    assert [len(target_taps(DrafterTrainConfig(), layers)) for layers in (1, 2, 3, 4, 36)] == [1, 1, 1, 2, 3]


def test_learning_rate_schedule(tiny_target):
    """transformers' warm-up + cosine to a floor: lr x s / w over w = warmup_frac x T warm-up steps (0 at
    step 0), then lr x (m + (1 - m)(1 + cos(pi (s - w) / (T - w))) / 2); a longer plan (a resume, or a
    time budget's count) continues from the current step."""
    import math

    from blockspec.train.trainer import CosineSchedule

    weight = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([weight], lr=2.0)
    schedule = CosineSchedule(opt, warmup_frac=0.2, min_ratio=0.1)

    def expected(s: int, total: int) -> float:
        w = int(0.2 * total)
        if s < w:
            return 2.0 * s / w
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - w) / (total - w))))

    for s in range(20):
        schedule.plan(10 if s < 5 else 20, s)
        assert schedule.lr() == pytest.approx(expected(s, 10 if s < 5 else 20)), s
        opt.step()
        schedule.step()
    assert expected(19, 20) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 15 / 16))))


def test_train_cli_flags_have_help_choices_and_one_line_errors(tmp_path, capsys):
    """Every `blockspec train` flag has help text and shows its default; method and Markov head types are
    choices; a missing --data path is one line naming it, before any model loads."""
    from blockspec.cli import main
    from blockspec.train.trainer import build_arg_parser

    parser = build_arg_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) > 50 and all(a.help for a in options), [a.dest for a in options if not a.help]
    choices = {a.dest: a.choices for a in options if a.choices}
    assert list(choices["method"]) == ["dflash", "dspark"] and list(choices["markov_head_type"]) == [
        "vanilla", "gated", "rnn"]
    text = parser.format_help()
    assert "drafter family (default: dflash)" in text and "--max-steps MAX_STEPS" in text
    assert "(default: None)" not in text  # a None default is said in words: "(None: the target's)"
    negations = {a.option_strings[0]: a.help for a in options if a.option_strings[0].startswith("--no_")}
    assert negations["--no_progress"] == "turn --progress off (show a progress bar; default: on)", negations
    args = parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--target-layer-ids", "1", "3",
                              "--no-confidence-head", "--resume", "--max-steps", "40"])
    assert args.target_layer_ids == [1, 3] and args.confidence_head is False and args.resume is True
    assert args.max_steps == 40
    with pytest.raises(SystemExit):
        parser.parse_args(["--target", "t", "--data", "d", "--out", "o", "--method", "medusa"])
    capsys.readouterr()
    missing = tmp_path / "no-such.jsonl"
    assert main(["train", "--target", str(tmp_path / "no-target"), "--data", str(missing), "--out",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --data {missing}: no such file, directory or glob match\n"
    # an output path in the way fails before the target loads, not after the training
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    for flag in ("--out", "--checkpoint-dir"):
        paths = {"--out": str(tmp_path / "out"), "--checkpoint-dir": str(tmp_path / "ck"), flag: str(blocker)}
        assert main(["train", "--target", str(tmp_path / "no-target"), "--data", str(data),
                     *(x for kv in paths.items() for x in kv)]) == 2
        assert capsys.readouterr().err == f"error: {flag} {blocker}: exists and is not a directory\n"


@pytest.mark.parametrize("field, value, says", [
    ("max_steps", 0, "--max-steps must be an integer >= 1"), ("loss_decay_gamma", 0.0, "--loss-decay-gamma must be"),
    ("lr", float("nan"), "--lr must be a number > 0"), ("lr", -1.0, "--lr must be"), ("warmup_frac", 2.0, "in \\[0, 1\\)"),
    ("min_lr_ratio", -1.0, "--min-lr-ratio"), ("grad_clip", -1.0, "--grad-clip"), ("eval_frac", 1.5, "--eval-frac"),
    ("max_minutes", 0.0, "--max-minutes must be a number > 0"), ("num_target_features", 0, "--num-target-features"),
    ("num_layers", 0, "--num-layers"), ("block_size", 100000, "--block-size must be at most 256"),
    ("num_heads", 0, "--num-heads must be an integer >= 1, or None"), ("head_dim", -8, "--head-dim"),
    ("eval_batches", 0, "--eval-batches must be an integer >= 1"), ("eval_every", -1, "--eval-every"),
    ("checkpoint_every", -2, "--checkpoint-every"), ("regen_max_new_tokens", 0, "--regen-max-new-tokens"),
    ("ce_alpha", 0.0, "no loss trains the drafts")])
def test_training_numbers_out_of_range_are_refused_by_name(field, value, says):
    """Each used to train (gamma 0: on NaN losses, exported with exit 0), never stop (max_steps 0), or fail
    deep in the optimiser; now a ConfigError naming the flag before any work."""
    with pytest.raises(ConfigError, match=says):
        DrafterTrainConfig(method="dflash", **{field: value})


def test_drafter_loss_ignores_invalid_blocks(tiny_target):
    target, _ = tiny_target
    cfg = DrafterTrainConfig(method="dflash", num_layers=1, block_size=4, device="cpu")
    drafter = build_drafter(cfg, target.config, mask_token_id=95).cast("cpu", torch.float32)
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(1, 12, dtype=torch.long)
    anchors = torch.tensor([[2, 9]])
    full = drafter_loss(drafter, target, ids, mask, anchors, torch.tensor([[True, True]]), cfg)
    # anchor 9: labels 10, 11 inside, 12 outside -> a valid prefix of 2; anchor 2: all 3 slots
    assert full.valid.sum(-1).tolist() == [[3, 2]]
    one = drafter_loss(drafter, target, ids, mask, anchors, torch.tensor([[True, False]]), cfg)
    assert one.valid.sum().item() == 3
    greedy_labels = DrafterTrainConfig(method="dflash", num_layers=1, block_size=4, device="cpu", labels="target")
    other = drafter_loss(drafter, target, ids, mask, anchors, torch.tensor([[True, True]]), greedy_labels)
    assert other.parts["ce"] != full.parts["ce"] and torch.equal(other.match, full.match)


def test_kl_term_distills_the_target_distribution(tiny_target):
    """kl_alpha adds KL(target || drafter) over the valid draft positions, weighted as the CE term: with CE
    off it is the whole loss, positive for an untrained drafter, and its gradient reaches the drafter;
    beside CE the two add. Without it no KL is computed; a negative weight is refused, naming it."""
    target, _ = tiny_target
    base = dict(method="dflash", num_layers=1, block_size=4, device="cpu")
    drafter = build_drafter(DrafterTrainConfig(**base), target.config, mask_token_id=95).cast("cpu", torch.float32)
    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    args = (drafter, target, ids, torch.ones(1, 12, dtype=torch.long), torch.tensor([[2, 9]]),
            torch.tensor([[True, True]]))
    kl_only = drafter_loss(*args, DrafterTrainConfig(**base, ce_alpha=0.0, kl_alpha=1.0))
    assert kl_only.parts["kl"] > 0 and kl_only.loss.item() == pytest.approx(kl_only.parts["kl"], rel=1e-6)
    kl_only.loss.backward()
    assert all(p.grad is not None for p in drafter.layers.parameters())
    assert any(p.grad.abs().sum() > 0 for p in drafter.layers.parameters())
    both = drafter_loss(*args, DrafterTrainConfig(**base, kl_alpha=0.5))
    assert both.loss.item() == pytest.approx(both.parts["ce"] + 0.5 * both.parts["kl"], rel=1e-5)
    assert both.parts["kl"] == pytest.approx(kl_only.parts["kl"], rel=1e-6)
    assert "kl" not in drafter_loss(*args, DrafterTrainConfig(**base)).parts
    with pytest.raises(ConfigError, match=r"kl_alpha must be a number >= 0, got -1.0"):
        DrafterTrainConfig(**base, kl_alpha=-1.0)


def test_engine_acceptance_reads_the_engines_counters(tmp_path):
    """The recipe's acceptance through blockspec's engine: the counters of the run, read from the engine's
    dict (get_stats), not through get_metrics()'s deprecated string keys."""
    import warnings
    from pathlib import Path

    from blockspec.train.trainer import engine_acceptance
    from factories import save_drafter_target

    target = save_drafter_target(tmp_path / "target")
    drafter = Path(__file__).parent / "fixtures" / "drafters" / "dflash"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = engine_acceptance(target, "dflash", drafter, [[5, 6, 7, 8], [9, 10]], 12, device="cpu")
    assert not [w for w in caught if "get_stats" in str(w.message)]
    assert stats["num_drafts"] > 0 and stats["mean_acceptance_length"] >= 1.0
    assert len(stats["acceptance_rate_per_pos"]) == len(stats["num_accepted_tokens_per_pos"]) > 0


def test_regenerate_replaces_responses_with_target_greedy(tiny_target):
    from blockspec.train.trainer import _plain_greedy, regenerate_examples

    target, path = tiny_target
    cfg = DrafterTrainConfig(method="dflash", max_len=20, regen_prompt_tokens=6, device="cpu", progress=False)
    chat_like = Example(list(range(10, 18)), [0] * 5 + [1] * 3)  # prompt = the 5 unsupervised tokens
    text = Example(list(range(30, 50)), [1] * 20)  # fully supervised: prompt = first 6 tokens
    out = regenerate_examples(path, [chat_like, text], cfg, device="cpu")
    for ex, cut in zip(out, (5, 6)):
        assert ex.loss_mask == [0] * cut + [1] * (len(ex.input_ids) - cut)
        prompt = ex.input_ids[:cut]
        assert ex.input_ids[cut:] == _plain_greedy(target, prompt, 20 - cut, {1})


def test_max_len_is_bounded_by_the_targets_positions(tiny_target):
    """--max-len past the target's max_position_embeddings trained on positions the target never learned (it was
    accepted); at the bound, regenerating continuations fits the engine's context (it asked for one more)."""
    from blockspec.train.trainer import regenerate_examples

    target, path = tiny_target
    bound = target.config.max_position_embeddings
    over = DrafterTrainConfig(method="dflash", max_len=bound + 1, max_steps=1, device="cpu", progress=False)
    with pytest.raises(ConfigError, match=rf"--max-len {bound + 1} exceeds the target's max_position_embeddings "
                                          rf"\({bound}\)"):
        train_drafter(path, _pattern_examples(4, 16, seed=1), over)
    at = DrafterTrainConfig(method="dflash", max_len=bound, regen_max_new_tokens=3, device="cpu", progress=False)
    (out,) = regenerate_examples(path, [Example(list(range(10, 18)), [0] * 5 + [1] * 3)], at, device="cpu")
    assert out.loss_mask == [0] * 5 + [1] * 3


def test_the_export_records_its_engine_acceptance_for_the_draft_length_policy(tiny_target, tmp_path):
    """A drafter trained for a target directory is measured through the engine on held-out prompts (every step
    verifying the whole block) and the figures written beside it as acceptance.json, which the loader reads
    as the draft-length policy's prior; acceptance_prompts 0 writes none."""
    from blockspec.drafters.formats import ACCEPTANCE_FILE, read_recorded_acceptance

    _, target_dir = tiny_target
    data = _pattern_examples(24, 24, seed=1)
    cfg = DrafterTrainConfig(method="dflash", num_layers=1, block_size=4, max_len=24, batch_size=8, num_anchors=8,
                             lr=1e-2, warmup_frac=0.0, max_steps=20, device="cpu", progress=False, eval_batches=1,
                             mask_token_id=95, acceptance_prompts=3)
    result = train_drafter(target_dir, data, cfg, eval_data=_pattern_examples(4, 24, seed=2), out_dir=tmp_path / "d")
    measured = result.metrics["engine_acceptance"]
    recorded = read_recorded_acceptance(tmp_path / "d", 4)
    assert measured["num_drafts"] > 0 and recorded == pytest.approx(measured["acceptance_rate_per_pos"])
    assert len(recorded) == 3 and all(a >= b for a, b in zip(recorded, recorded[1:]))
    assert "on 3 held-out prompts (blockspec train)" in json.loads((tmp_path / "d" / ACCEPTANCE_FILE).read_text())[
        "measured_on"]
    none = dataclasses.replace(cfg, acceptance_prompts=0, max_steps=1)
    train_drafter(target_dir, data, none, eval_data=data[:2], out_dir=tmp_path / "n")
    assert not (tmp_path / "n" / ACCEPTANCE_FILE).exists()
    # over the measured drafter's export, an export that measures nothing leaves no figures of the old one
    # (the engine read them as its own, and refused them where the block differs)
    train_drafter(target_dir, data, dataclasses.replace(none, block_size=3), eval_data=data[:2], out_dir=tmp_path / "d")
    assert not (tmp_path / "d" / ACCEPTANCE_FILE).exists()
