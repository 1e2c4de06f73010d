"""Drafter models (DFlash, DSpark) against fixtures produced by the reference implementations.

tests/fixtures/drafters/README.md says which reference commit produced each fixture and how.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.errors import ModelLoadError
from blockspec.drafters import (
    DFlashDraft,
    DSparkDraft,
    build_target_layer_ids,
    load_dflash,
    load_drafter,
    load_dspark,
    restore_target_copies,
    save_dflash,
    save_dspark,
    strip_target_copies,
)
from blockspec.drafters.backbone import DraftModel
from blockspec.drafters.formats import TARGET_COPIES
from factories import DRAFTER_TARGET_KW, TRITON_SKIP_REASON, hf_config, triton_interpretable

FIX = Path(__file__).parent / "fixtures" / "drafters"
DFLASH_CASES = ["dflash", "dflash_swa", "dflash_swa_noncausal"]
DSPARK_CASES = ["dspark_vanilla", "dspark_gated", "dspark_rnn"]
ATOL = 1e-5
# the Triton kernel runs in Triton's interpreter on the CPU (conftest); skipped where triton is missing
BACKENDS = ["sdpa", pytest.param("triton", marks=pytest.mark.skipif(not triton_interpretable(),
                                                                     reason=TRITON_SKIP_REASON))]



@pytest.fixture(autouse=True)
def _no_grad():
    """Inference-only tests; scoped per test so grad mode never leaks into other test files."""
    with torch.no_grad():
        yield


class StubTarget(nn.Module):
    """The target's embedding and LM head as stored in the fixtures (what DFlash borrows)."""

    def __init__(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embed.clone())
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight.data.copy_(head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def fixture(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    d = FIX / name
    return load_file(str(d / "expected.safetensors")), json.loads((d / "meta.json").read_text())


def target_config(**kw) -> ModelConfig:
    args = dict(DRAFTER_TARGET_KW)
    args.update(kw)
    return ModelConfig.from_hf(hf_config("qwen3", **args).to_dict())


def load(name: str, path: Path | None = None, backend: str = "sdpa"):
    path = path or FIX / name
    fn = load_dspark if name.startswith("dspark") else load_dflash
    model = fn(path, device="cpu", dtype=torch.float32)
    model.attention_backend = backend
    return model


def run_steps(model, exp, meta, embed=None, slot=1):
    """Replay the fixture's schedule: append each step's new context, then draft the block."""
    cache = model.new_cache(4, 64)
    outs = []
    for start, lo, hi in meta["steps"]:
        model.append_context(cache, [slot], [lo], [hi - lo], exp["features"][None, lo:hi])
        outs.append(model.block_hidden(cache, [slot], [start], exp["tokens"][start:start + 1], embed))
    return outs


# ------------------------------------------------------------------------------ reference equality
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DFLASH_CASES)
def test_dflash_matches_reference(name, backend):
    exp, meta = fixture(name)
    model = load(name, backend=backend)
    assert isinstance(model, DFlashDraft) and not model.anchor_first
    assert model.num_draft_slots == meta["block_size"] - 1
    assert model.target_layer_ids == tuple(meta["target_layer_ids"])
    target = StubTarget(exp["embed"], exp["lm_head"])
    model.check_target(target_config())
    for i, h in enumerate(run_steps(model, exp, meta, target.embed)):
        assert (h[0] - exp[f"hidden_{i}"]).abs().max() <= ATOL
        logits = model.logits(model.slot_hidden(h), target)
        assert (logits[0] - exp[f"logits_{i}"]).abs().max() <= ATOL


def test_dflash_causality_and_window_parsed():
    assert load("dflash").config.causal == (False, False)
    swa = load("dflash_swa").config
    assert swa.causal == (True, False) and swa.sliding_window == 5 and swa.window_mode == "query"
    nc = load("dflash_swa_noncausal").config
    assert nc.causal == (False, False) and nc.is_causal is False and nc.sliding_window == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", DSPARK_CASES)
def test_dspark_matches_reference(name, backend):
    exp, meta = fixture(name)
    model = load(name, backend=backend)
    assert isinstance(model, DSparkDraft) and model.anchor_first
    assert model.num_draft_slots == meta["block_size"] and model.markov_head_type == meta["markov_head_type"]
    model.check_target(target_config())
    for i, h in enumerate(run_steps(model, exp, meta)):  # own embed_tokens copy, as DeepSpec does
        assert (h[0] - exp[f"hidden_{i}"]).abs().max() <= ATOL
        sh = model.slot_hidden(h)
        base = model.logits(sh)
        assert (base[0] - exp[f"base_logits_{i}"]).abs().max() <= ATOL
        anchor = exp["tokens"][meta["steps"][i][0]][None]
        tokens, conf = model.draft_greedy(base, sh, anchor)
        assert torch.equal(tokens[0], exp[f"draft_tokens_{i}"])
        assert (conf[0] - exp[f"confidence_logits_{i}"].sigmoid()).abs().max() <= ATOL
        # corrected logits along the greedy path, from markov_step (the single source of the formula)
        prev, state = anchor, None
        for k in range(sh.shape[1]):
            bias, state = model.markov_step(k, sh[:, k], prev, state)
            assert (base[0, k] + bias[0] - exp[f"corrected_logits_{i}"][k]).abs().max() <= ATOL
            prev = tokens[:, k]
        # teacher-forced on random previous tokens (rnn: state carried across positions)
        prev_tf = exp[f"tf_prev_{i}"][None]
        state = None
        for k in range(sh.shape[1]):
            bias, state = model.markov_step(k, sh[:, k], prev_tf[:, k], state)
            assert (bias[0] - exp[f"tf_bias_{i}"][k]).abs().max() <= ATOL
            c = model.confidence(sh[:, k], prev_tf[:, k], logits=True)
            assert (c[0] - exp[f"tf_confidence_logits_{i}"][k]).abs().max() <= ATOL


def test_dspark_speculators_reduced_vocab_matches_reference():
    exp, meta = fixture("dspark_speculators")
    gated, _ = fixture("dspark_gated")
    model = load("dspark_speculators")
    assert model.source_format == "speculators" and model.anchor_first
    assert model.target_layer_ids == (-1, 1, 3)  # aux_hidden_state_layer_ids [0, 2, 4] are HF indices
    assert model.draft_vocab_size == 64 and model.heads.confidence_head_with_markov is False
    model.check_target(target_config())
    subset = torch.tensor(meta["draft_subset"])
    assert torch.equal(model.draft_to_target(torch.arange(64)), subset)
    assert torch.equal(model.target_index(), subset)
    for i, h in enumerate(run_steps(model, gated, meta)):
        assert (h[0] - gated[f"hidden_{i}"]).abs().max() <= ATOL
        sh = model.slot_hidden(h)
        base = model.logits(sh)
        assert base.shape[-1] == 64
        assert (base[0] - gated[f"base_logits_{i}"][:, subset]).abs().max() <= ATOL
        tokens, conf = model.draft_greedy(base, sh, gated["tokens"][meta["steps"][i][0]][None])
        assert torch.equal(tokens[0], exp[f"draft_tokens_{i}"]) and conf is not None
        state, prev = None, gated[f"tf_prev_{i}"][None]
        for k in range(sh.shape[1]):
            bias, state = model.markov_step(k, sh[:, k], prev[:, k], state)
            assert (bias[0] - exp[f"tf_bias_{i}"][k]).abs().max() <= ATOL
    probs = torch.softmax(torch.randn(2, 3, 64), -1)
    full = model.scatter_to_target(probs, 96)
    assert full.shape == (2, 3, 96) and torch.allclose(full.sum(-1), torch.ones(2, 3))
    assert torch.equal(full[..., subset], probs) and full[..., [i for i in range(96) if i not in subset]].eq(0).all()
    logits_full = model.scatter_to_target(torch.randn(2, 64), 96, fill=float("-inf"))
    assert torch.isneginf(logits_full).sum() == 2 * 32


def test_draft_greedy_top_k():
    exp, meta = fixture("dspark_rnn")
    model = load("dspark_rnn")
    h = run_steps(model, exp, meta)[-1]
    sh = model.slot_hidden(h)
    base = model.logits(sh)
    anchor = exp["tokens"][meta["steps"][-1][0]][None]
    full, _ = model.draft_greedy(base, sh, anchor)
    assert torch.equal(model.draft_greedy(base, sh, anchor, top_k=96)[0], full)
    topk, _ = model.draft_greedy(base, sh, anchor, top_k=3)
    prev, state = anchor, None  # brute force: bias over the whole vocab, then keep the top-3 of U_k
    for k in range(sh.shape[1]):
        bias, state = model.markov_step(k, sh[:, k], prev, state)
        cand = base[:, k].topk(3).indices
        pick = cand.gather(-1, (base[:, k] + bias).gather(-1, cand).argmax(-1, keepdim=True)).squeeze(-1)
        assert torch.equal(pick, topk[:, k])
        prev = pick


def test_vanilla_markov_bias_rows_are_remembered_exactly(monkeypatch):
    """On the CPU a vanilla head's bias B(t) = W2 W1[t] is remembered per previous token t: a row found
    again is the one a one-row step computes, bit for bit; several rows equal the batched product
    within fp32 rounding; an in-place change of W2 drops every row; the least recently used row goes
    first when the rows fill their memory."""
    import blockspec.drafters.dspark as dspark

    model = load("dspark_vanilla")
    head, rows = model.markov_head, model.bias_rows

    def computed(ids):  # the product a step computes for its rows
        return head.markov_w2(head.markov_w1(torch.tensor(ids))).float()

    first, _ = model.markov_step(0, None, torch.tensor([5]), None)
    again, _ = model.markov_step(3, None, torch.tensor([5]), None)
    assert torch.equal(first, computed([5])) and again.data_ptr() == first.data_ptr()  # found, not recomputed
    batch, _ = model.markov_step(0, None, torch.tensor([7, 5, 9]), None)
    assert torch.allclose(batch, computed([7, 5, 9]), atol=1e-6) and torch.equal(batch[1], first[0])
    head.markov_w2.weight.mul_(2.0)  # an update in place (a training step) is seen
    doubled, _ = model.markov_step(0, None, torch.tensor([5]), None)
    assert torch.equal(doubled, computed([5])) and not torch.equal(doubled, first)
    monkeypatch.setattr(dspark, "BIAS_ROWS_BYTES", 2 * 4 * head.markov_w2.weight.shape[0])  # room for two rows
    for t in (1, 2, 1, 3):
        model.markov_step(0, None, torch.tensor([t]), None)
    assert list(rows.rows) == [1, 3]
    with torch.enable_grad():  # training computes the bias through autograd, never from the rows
        bias, _ = model.markov_step(0, None, torch.tensor([4]), None)
    assert 4 not in rows.rows


def test_the_cpus_remembered_vanilla_loop_drafts_as_the_generic_loop(monkeypatch):
    """On the CPU without autograd a vanilla head drafts through its remembered bias rows and NumPy's add and
    argmax (`_draft_greedy_remembered`): the same tokens as the generic loop (autograd on: the bias computed per
    position), over several rows, with ties to the first id, and through a reduced vocabulary's d2t map.
    Negative control: bias rows that stay the anchors' (the previous draft not fed back) draft differently."""
    model = load("dspark_vanilla")
    g = torch.Generator().manual_seed(0)
    r, k, v = 3, model.num_draft_slots, model.markov_head.markov_w2.weight.shape[0]
    base = torch.randn(r, k, v, generator=g) * 4
    base[1, 2, 7] = base[1, 2, 9] = base[1, 2].max() + 50.0  # a tie, far above any bias: the first id wins
    anchors = torch.tensor([3, 11, 5])
    sh = torch.zeros(r, k, model.config.hidden_size)

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            fast = model.draft_greedy(base, sh, anchors)[0]
        with torch.enable_grad():
            generic = model.draft_greedy(base, sh, anchors)[0]
        return fast, generic

    fast, generic = both()
    assert torch.equal(fast, generic) and fast[1, 2] == 7
    shift = torch.randperm(v, generator=g)
    with monkeypatch.context() as m:
        m.setattr(model, "d2t", shift - torch.arange(v))  # draft id i stands for target id shift[i]
        m.setattr(model, "use_own_head", True)
        fast, mapped = both()
        assert torch.equal(fast, mapped) and fast[1, 2] == shift[7] and not torch.equal(mapped, generic)
    rows_for = model.bias_rows.rows_for
    monkeypatch.setattr(model.bias_rows, "rows_for", lambda head, prev, scale: rows_for(head, anchors.tolist(), scale))
    with torch.no_grad():
        assert not torch.equal(model.draft_greedy(base, sh, anchors)[0], generic)


# ------------------------------------------------------------------------------ the rows a step verifies
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dflash_swa_noncausal", "dspark_vanilla"])  # later rows are keys of earlier ones
def test_a_step_computes_only_the_rows_it_verifies(name, backend):
    """`rows` (the rows holding the drafts a step verifies) gives those rows of the whole block's
    forward: the last layer's queries shrink, every row's K/V stays a key. Negative control: a block
    of only those rows (the later rows' K/V left out) drafts differently."""
    exp, meta = fixture(name)
    model = load(name, backend=backend)
    embed = StubTarget(exp["embed"], exp["lm_head"]).embed if "embed" in exp else None
    feats, toks = exp["features"], exp["tokens"]
    cache = model.new_cache(2, 64)
    model.append_context(cache, [1, 0], [0, 0], [9, 6], torch.stack([feats[:9], torch.cat([feats[:6], feats[:3]])]))
    anchors = toks[torch.tensor([9, 6])]
    full = model.block_hidden(cache, [1, 0], [9, 6], anchors, embed)
    for k in (1, 3, model.num_draft_slots - 1):
        rows = model.block_rows(k)
        assert rows == k + (0 if model.anchor_first else 1)
        part = model.block_hidden(cache, [1, 0], [9, 6], anchors, embed, rows=rows)
        assert part.shape == (2, rows, full.shape[-1])
        assert (part - full[:, :rows]).abs().max() <= ATOL
        assert model.slot_hidden(part, k).shape == model.slot_hidden(full, k).shape == (2, k, full.shape[-1])
    rows = model.block_rows(1)
    assert rows < meta["block_size"]
    model.block_size = rows
    try:
        short = model.block_hidden(cache, [1, 0], [9, 6], anchors, embed)
    finally:
        model.block_size = meta["block_size"]
    assert (short - full[:, :rows]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["dspark_vanilla", "dflash_swa", "dflash_swa_noncausal"])
def test_a_block_whose_rows_see_every_key_runs_unmasked_as_the_masked_forward(name):
    """Where every request's context fills the keys gathered (one request always does), the reference
    path drops the mask of each non-causal full-attention layer, and its rows equal the masked forward's.
    A causal or sliding-window layer keeps its mask; a batch of unequal contexts keeps every mask."""
    exp, _ = fixture(name)
    model = load(name)
    c = model.config
    embed = StubTarget(exp["embed"], exp["lm_head"]).embed if "embed" in exp else None
    feats, toks = exp["features"], exp["tokens"]
    cache = model.new_cache(2, 64)
    model.append_context(cache, [1, 0], [0, 0], [9, 6], torch.stack([feats[:9], torch.cat([feats[:6], feats[:3]])]))
    ctx, slot, anchor = torch.tensor([9]), torch.tensor([1]), toks[9:10]
    positions = ctx[:, None] + torch.arange(model.block_size)[None, :]
    opened = [m is None for m in model._block_masks(ctx, positions, 9, every_key=True)]
    assert opened == [not causal and lt != "sliding_attention" for lt, causal in zip(c.layer_types, c.causal)]
    assert all(m is not None for m in model._block_masks(ctx, positions, 9))
    unmasked = model.block_hidden_tensors(cache, slot, ctx, anchor, 9, embed, every_key=True)
    masked = model.block_hidden_tensors(cache, slot, ctx, anchor, 9, embed)
    assert (unmasked - masked).abs().max() <= ATOL
    assert torch.equal(model.block_hidden(cache, [1], [9], anchor, embed), unmasked)
    # two contexts of 9 and 6 keys: the shorter one's last 3 gathered keys are not its own, so no layer opens
    both = torch.tensor([9, 6])
    assert all(m is not None for m in model._block_masks(both, both[:, None] + torch.arange(model.block_size), 9,
                                                         every_key=False))
    # negative control: the shorter request run unmasked over 9 gathered keys sees the other's 3 and drafts otherwise
    if all(opened):
        wrong = model.block_hidden_tensors(cache, torch.tensor([1, 0]), both, toks[both], 9, embed, every_key=True)
        right = model.block_hidden(cache, [1, 0], [9, 6], toks[both], embed)
        assert (wrong[1] - right[1]).abs().max() > 1e-3
        assert (wrong[0] - right[0]).abs().max() <= ATOL


# ------------------------------------------------------------------------------ batching and cache
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dflash_swa", "dspark_rnn"])
def test_batched_equals_single(name, backend):
    exp, meta = fixture(name)
    model = load(name, backend=backend)
    embed = StubTarget(exp["embed"], exp["lm_head"]).embed if "embed" in exp else None
    feats, toks = exp["features"], exp["tokens"]
    # three requests: different prompt lengths, then uneven commits (one request commits nothing)
    prompts, commits, slots = [5, 11, 8], [3, 0, 2], [2, 0, 3]
    batch = model.new_cache(4, 64)
    c = max(prompts)
    padded = torch.zeros(3, c, feats.shape[-1])
    for r, n in enumerate(prompts):
        padded[r, :n] = feats[:n]
    model.append_context(batch, slots, [0] * 3, prompts, padded)
    ends = [p + m for p, m in zip(prompts, commits)]
    padded = torch.full((3, max(commits), feats.shape[-1]), 7.0)  # padding rows carry junk on purpose
    for r in range(3):
        padded[r, : commits[r]] = feats[prompts[r]:ends[r]]
    model.append_context(batch, slots, prompts, commits, padded)
    hb = model.block_hidden(batch, slots, ends, toks[torch.tensor(ends)], embed)
    for r in range(3):
        single = model.new_cache(1, 64)
        model.append_context(single, [0], [0], [ends[r]], feats[None, : ends[r]])
        hs = model.block_hidden(single, [0], [ends[r]], toks[ends[r]][None], embed)
        assert (hb[r] - hs[0]).abs().max() <= ATOL


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["dflash_swa_noncausal", "dspark_vanilla"])
def test_block_kv_never_persists(name, backend):
    """The block's K/V never become context: the reference path never writes them; the kernel path
    writes them only past the context, where the next append overwrites them."""
    exp, meta = fixture(name)
    model = load(name, backend=backend)
    embed = StubTarget(exp["embed"], exp["lm_head"]).embed if "embed" in exp else None
    feats, toks = exp["features"], exp["tokens"]
    cache = model.new_cache(2, 64)
    model.append_context(cache, [1], [0], [9], feats[None, :9])
    before = [t.clone() for t in cache.k + cache.v]
    h1 = model.block_hidden(cache, [1], [9], toks[9:10], embed)
    kept = 9 if backend == "triton" else None  # columns that must be untouched
    assert all(torch.equal(a[:, :, :kept], b[:, :, :kept]) for a, b in zip(before, cache.k + cache.v))
    h2 = model.block_hidden(cache, [1], [9], toks[9:10], embed)
    assert torch.equal(h1, h2)
    # appending after a block equals a fresh cache fed the same context
    model.append_context(cache, [1], [9], [4], feats[None, 9:13])
    fresh = model.new_cache(2, 64)
    model.append_context(fresh, [1], [0], [13], feats[None, :13])
    a = model.block_hidden(cache, [1], [13], toks[13:14], embed)
    b = model.block_hidden(fresh, [1], [13], toks[13:14], embed)
    assert (a - b).abs().max() <= ATOL
    # stale rows beyond ctx_len (a longer earlier context in the slot) are ignored
    model.append_context(fresh, [1], [13], [5], feats[None, 13:18])
    c = model.block_hidden(fresh, [1], [13], toks[13:14], embed)
    assert (a - c).abs().max() <= ATOL


def test_every_layers_context_kv_is_each_layers_and_follows_a_weight_changed_in_place():
    """`DraftModel.context_kv` (every layer's context K/V in one product, norm and rotation) equals each layer's
    k and v rows of its projection, k normed by its own weight and rotated; its stacked weights are kept, and made
    again when one changes in place (control: the kept ones give the old values)."""
    from blockspec.models.layers import apply_rotary, rms_norm

    model = load("dspark_vanilla")
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 5, model.config.hidden_size, generator=g)
    cos, sin = model._rope(torch.arange(3, 8).expand(2, 5), 16)

    def by_layer():
        ks, vs = [], []
        for layer in model.layers:
            a = layer.self_attn
            k, v = a.qkv_proj(ctx)[..., a.q_size:].split([a.kv_size, a.kv_size], dim=-1)
            k = rms_norm(k.view(2, 5, a.kv_heads, a.head_dim), a.k_norm.weight, a.k_norm.eps)
            ks.append(apply_rotary(k.transpose(1, 2), cos, sin))
            vs.append(v.view(2, 5, a.kv_heads, a.head_dim).transpose(1, 2))
        return torch.stack(ks), torch.stack(vs)

    k, v = model.context_kv(ctx, cos, sin)
    want_k, want_v = by_layer()
    assert len(model.layers) > 1 and torch.allclose(k, want_k, atol=1e-5) and torch.allclose(v, want_v, atol=1e-5)
    kept = model._context_weights
    model.layers[1].self_attn.k_norm.weight.mul_(2.0)
    model.layers[0].self_attn.qkv_proj.weight[-1].add_(1.0)  # a v row of the first layer
    k, v = model.context_kv(ctx, cos, sin)
    want_k, want_v = by_layer()
    assert torch.allclose(k, want_k, atol=1e-5) and torch.allclose(v, want_v, atol=1e-5)
    stale = nn.functional.linear(ctx, kept[0]).view(2, 5, len(model.layers), 2, -1)[:, :, 0, 1]
    assert not torch.allclose(stale, want_v[0].transpose(1, 2).flatten(2), atol=1e-3)


def test_cache_shape_and_limits():
    model = load("dspark_vanilla")
    cache = model.new_cache(3, 20)
    # three slots of 21 positions (the trash position included) in pages of 64, plus the trash page
    assert len(cache.k) == 2 and cache.k[0].shape == (3 + 1, 2, 64, 8) and cache.pages.max_slots == 3
    with pytest.raises(ValueError, match="beyond the cache"):
        model.append_context(cache, [0], [18], [4], torch.zeros(1, 4, 96))


# ------------------------------------------------------------------------------ save / load
def _same_weights(a: Path, b: Path) -> None:
    """Two checkpoint directories hold the same tensor names with bitwise-equal values."""
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def _same_outputs(a, b, name):
    exp, meta = fixture(name if name in DFLASH_CASES + DSPARK_CASES else "dspark_gated")
    embed = StubTarget(exp["embed"], exp["lm_head"]).embed if "embed" in exp else None
    for x, y in zip(run_steps(a, exp, meta, embed), run_steps(b, exp, meta, embed)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("name", DFLASH_CASES)
def test_dflash_zlab_round_trip(name, tmp_path):
    model = load(name)
    save_dflash(model, tmp_path / "out")
    _same_weights(tmp_path / "out", FIX / name)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    src = json.loads((FIX / name / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 95
    for key in ("block_size", "hidden_size", "num_hidden_layers", "layer_types", "num_target_layers", "head_dim"):
        assert cfg[key] == src[key], key
    assert cfg["dflash_config"]["target_layer_ids"] == src["dflash_config"]["target_layer_ids"]
    assert cfg.get("is_causal") == src.get("is_causal")
    again = load_dflash(tmp_path / "out", device="cpu", dtype=torch.float32)
    assert again.config == model.config
    _same_outputs(model, again, name)


def test_dflash_speculators_round_trip(tmp_path):
    exp, _ = fixture("dflash")
    model = load("dflash")
    target = StubTarget(exp["embed"], exp["lm_head"])
    save_dflash(model, tmp_path / "spec", format="speculators", target=target)
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["sample_from_anchor"] is False and cfg["draft_vocab_size"] == 96
    spec = load_drafter("dflash", tmp_path / "spec", device="cpu", dtype=torch.float32)
    assert spec.source_format == "speculators" and spec.target_layer_ids == model.target_layer_ids
    assert spec.num_draft_slots == 3
    spec.check_target(target_config())
    _same_outputs(model, spec, "dflash")  # own embed_tokens copy == the target's rows
    h = run_steps(spec, exp, fixture("dflash")[1])[0]
    assert (spec.logits(spec.slot_hidden(h))[0] - exp["logits_0"]).abs().max() <= ATOL  # own lm_head copy
    save_dflash(spec, tmp_path / "spec2", format="speculators")
    _same_weights(tmp_path / "spec", tmp_path / "spec2")
    with pytest.raises(ValueError, match="no embedding/LM head"):
        save_dflash(spec, tmp_path / "zlab")


@pytest.mark.parametrize("name", DSPARK_CASES)
def test_dspark_deepspec_round_trip(name, tmp_path):
    model = load(name)
    save_dspark(model, tmp_path / "out")
    _same_weights(tmp_path / "out", FIX / name)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    src = json.loads((FIX / name / "config.json").read_text())
    for key in ("architectures", "block_size", "mask_token_id", "target_layer_ids", "markov_rank", "markov_head_type",
                "enable_confidence_head", "confidence_head_with_markov", "num_anchors", "num_target_layers",
                "tie_word_embeddings", "layer_types", "intermediate_size", "head_dim"):
        assert cfg[key] == src[key], key
    again = load_dspark(tmp_path / "out", device="cpu", dtype=torch.float32)
    assert again.config == model.config and again.heads == model.heads
    _same_outputs(model, again, name)


def test_dspark_speculators_round_trip(tmp_path):
    model = load("dspark_speculators")
    save_dspark(model, tmp_path / "out", format="speculators")
    _same_weights(tmp_path / "out", FIX / "dspark_speculators")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [0, 2, 4] and cfg["draft_vocab_size"] == 64
    assert cfg["markov_head_type"] == "gated" and cfg["sample_from_anchor"] is True
    again = load_dspark(tmp_path / "out", device="cpu", dtype=torch.float32)
    assert torch.equal(again.d2t, model.d2t)
    _same_outputs(model, again, "dspark_speculators")
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        save_dspark(model, tmp_path / "deepspec")
    # a full-vocab DeepSpec drafter converts to speculators and back
    vanilla = load("dspark_vanilla")
    save_dspark(vanilla, tmp_path / "v_spec", format="speculators")
    conv = load_dspark(tmp_path / "v_spec", device="cpu", dtype=torch.float32)
    assert conv.d2t is None and conv.heads.markov_head_type == "vanilla"
    _same_outputs(vanilla, conv, "dspark_vanilla")


def test_deepspec_without_embed_and_head_uses_target(tmp_path):
    exp, meta = fixture("dspark_vanilla")
    d = _copy(tmp_path, "dspark_vanilla")
    state = load_file(str(d / "model.safetensors"))
    embed, head = state.pop("embed_tokens.weight"), state.pop("lm_head.weight")
    save_file(state, str(d / "model.safetensors"))
    model = load_dspark(d, device="cpu", dtype=torch.float32)
    assert model.embed_tokens is None and model.lm_head is None
    target = StubTarget(embed, head)
    model.bind_target(target)
    model.check_target(target_config())
    h = run_steps(model, exp, meta)[0]
    assert (h[0] - exp["hidden_0"]).abs().max() <= ATOL
    assert (model.logits(model.slot_hidden(h))[0] - exp["base_logits_0"]).abs().max() <= ATOL
    with pytest.raises(ValueError, match="needs embed_tokens"):
        save_dspark(model, tmp_path / "out")
    save_dspark(model, tmp_path / "out", target=target)
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(
        load_file(str(FIX / "dspark_vanilla" / "model.safetensors")))


def test_markov_rank_zero(tmp_path):
    d = _copy(tmp_path, "dspark_vanilla")
    _edit(d, markov_rank=0, markov_head_type=None, enable_confidence_head=False)
    state = {k: v for k, v in load_file(str(d / "model.safetensors")).items() if "head." not in k or "lm_head" in k}
    save_file(state, str(d / "model.safetensors"))
    model = load_dspark(d, device="cpu", dtype=torch.float32)
    assert model.markov_step(0, torch.zeros(1, 32), torch.zeros(1, dtype=torch.long), None) == (None, None)
    base = torch.randn(2, 4, 96)
    tokens, conf = model.draft_greedy(base, torch.zeros(2, 4, 32), torch.zeros(2, dtype=torch.long))
    assert conf is None and torch.equal(tokens, base.argmax(-1))
    with pytest.raises(ValueError, match="no confidence head"):
        model.confidence(torch.zeros(1, 32), torch.zeros(1, dtype=torch.long))


# ------------------------------------------------------------------------------ errors
def _copy(tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(FIX / name, d)
    return d


def _edit(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if "." in k:
            outer, inner = k.split(".")
            if v is None:
                cfg[outer].pop(inner, None)
            else:
                cfg[outer][inner] = v
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    ({"dflash_config.mask_token_id": None}, "mask_token_id"),
    ({"block_size": None}, "block_size"),
    ({"block_size": 8}, "dflash_config.block_size|block_size"),
    ({"dflash_config.target_layer_ids": None, "num_target_layers": None}, "target_layer_ids"),
    ({"hidden_size": None}, "hidden_size"),
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": None}, "sliding_window"),
    # strings where JSON has booleans and numbers: bool("false") read as true (every layer causal), int("16")
    # and float("x") took or failed in Python's words; each is named now
    ({"is_causal": "false"}, r"field 'is_causal' must be true or false, got 'false'"),
    ({"attention_bias": "false"}, r"field 'attention_bias' must be true or false"),
    ({"head_dim": "16"}, r"field 'head_dim' must be a positive integer, got '16'"),
    ({"rms_norm_eps": "abc"}, r"field 'rms_norm_eps' must be a positive number"),
    ({"max_position_embeddings": "x"}, r"field 'max_position_embeddings' must be a positive integer"),
    ({"target_hidden_size": "x"}, r"field 'target_hidden_size' must be a positive integer"),
    ({"dflash_config.input_embedding_scale": "x"}, r"field 'input_embedding_scale' must be a positive number"),
])
def test_dflash_config_errors(tmp_path, changes, match):
    d = _copy(tmp_path, "dflash")
    if "block_size" in changes and changes["block_size"] == 8:
        _edit(d, **{"dflash_config.block_size": 4})
    _edit(d, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_dflash(d, device="cpu")


def test_dflash_default_layer_ids(tmp_path):
    d = _copy(tmp_path, "dflash")
    _edit(d, **{"dflash_config.target_layer_ids": None, "num_target_layers": 36})
    with pytest.raises(ModelLoadError, match="fc.weight input size"):  # 2 draft layers -> 2 taps, fc wants 3
        load_dflash(d, device="cpu")
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33] and build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize("changes,match", [
    ({"markov_head_type": "lstm"}, "unknown markov_head_type"),
    ({"markov_head_type": None}, "markov_head_type"),
    ({"markov_rank": None}, "markov_rank"),
    ({"enable_confidence_head": None}, "enable_confidence_head"),
    ({"confidence_head_with_markov": None}, "confidence_head_with_markov"),
    ({"target_layer_ids": [3, 1]}, "strictly increasing"),
    ({"mask_token_id": None}, "mask_token_id"),
    ({"architectures": ["Gemma4DSparkModel"]}, "Gemma4"),
    ({"markov_rank": 4}, "markov_head.markov_w1.weight"),
])
def test_dspark_config_errors(tmp_path, changes, match):
    d = _copy(tmp_path, "dspark_vanilla")
    _edit(d, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_dspark(d, device="cpu")


def test_weight_errors(tmp_path):
    d = _copy(tmp_path, "dflash")
    state = load_file(str(d / "model.safetensors"))
    bad = dict(state)
    bad["layers.1.mlp.down_proj.weight"] = bad["layers.1.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj\.weight: checkpoint shape"):
        load_dflash(d, device="cpu")
    bad = dict(state)
    del bad["norm.weight"]
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing tensors.*norm.weight"):
        load_dflash(d, device="cpu")
    bad = dict(state)
    del bad["layers.0.self_attn.k_proj.weight"]
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="k_proj"):
        load_dflash(d, device="cpu")
    bad = dict(state)
    bad["fc.weight"] = bad["fc.weight"][:, :64].contiguous()
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="fc.weight input size 64"):
        load_dflash(d, device="cpu")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_dflash(tmp_path / "nowhere", device="cpu")


def test_speculators_errors(tmp_path):
    d = _copy(tmp_path, "dspark_speculators")
    state = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "d2t"}, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t"):
        load_dspark(d, device="cpu")
    bad = dict(state)
    bad["d2t"] = torch.zeros(64, dtype=torch.int64) + 40  # maps past the target vocab
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t maps draft ids outside"):
        load_dspark(d, device="cpu")
    save_file(state, str(d / "model.safetensors"))
    _edit(d, aux_hidden_state_layer_ids=None)
    with pytest.raises(ModelLoadError, match="aux_hidden_state_layer_ids"):
        load_dspark(d, device="cpu")
    _edit(d, aux_hidden_state_layer_ids=[0, 2, 4], draft_vocab_size=None)
    with pytest.raises(ModelLoadError, match="draft_vocab_size"):
        load_dspark(d, device="cpu")
    _edit(d, draft_vocab_size=64, markov_head_type="bogus")
    with pytest.raises(ModelLoadError, match="unknown markov_head_type"):
        load_dspark(d, device="cpu")
    _edit(d, markov_head_type="gated")
    with pytest.raises(ModelLoadError, match="speculative_config method 'dspark'"):
        load_dflash(d, device="cpu")
    with pytest.raises(ModelLoadError, match="speculative_config method 'dflash'"):
        load_dspark(_spec_dflash(tmp_path), device="cpu")
    with pytest.raises(ConfigError, match="method"):
        load_drafter("eagle", d)


def _spec_dflash(tmp_path: Path) -> Path:
    exp, _ = fixture("dflash")
    save_dflash(load("dflash"), tmp_path / "spec_dflash", format="speculators", target=StubTarget(exp["embed"],
                                                                                                   exp["lm_head"]))
    return tmp_path / "spec_dflash"


def test_check_target_mismatches():
    dflash, dspark = load("dflash"), load("dspark_vanilla")
    with pytest.raises(ConfigError, match="hidden_size"):
        dflash.check_target(target_config(hidden=64))
    with pytest.raises(ConfigError, match="vocab_size"):
        dflash.check_target(target_config(vocab=128))
    with pytest.raises(ConfigError, match="target_layer_ids.*layer 4 is outside"):
        dflash.check_target(target_config(layers=4))
    with pytest.raises(ConfigError, match="last layer 3"):
        dspark.check_target(target_config(layers=4))
    with pytest.raises(ConfigError, match="rope_theta"):
        dflash.check_target(target_config(rope_theta=10000.0))
    with pytest.raises(ConfigError, match="markov_w1|embed_tokens|vocab"):
        dspark.check_target(target_config(vocab=128))
    # a drafter of another width that reads the target's features (fc fits them) but shares its embedding and head:
    # it loaded, then failed its first step in an RMSNorm of the wrong size
    wide = target_config(hidden=2 * dflash.config.hidden_size)
    dflash.config = dataclasses.replace(dflash.config, target_hidden_size=wide.hidden_size)
    with pytest.raises(ConfigError, match=r"hidden_size \d+ != the target's hidden_size \d+; the drafter shares the "
                                          r"target's embedding and LM head"):
        dflash.check_target(wide)
    dflash = load("dflash")
    dflash.check_target(target_config())  # the last layer is a valid DFlash tap (post-norm, as in HF)
    load("dspark_speculators").check_target(target_config())


def test_mask_id_outside_vocab(tmp_path):
    d = _copy(tmp_path, "dflash")
    _edit(d, **{"dflash_config.mask_token_id": 96})
    model = load_dflash(d, device="cpu")
    with pytest.raises(ConfigError, match="mask_token_id 96 is outside"):
        model.check_target(target_config())


def test_zlab_checkpoint_with_own_head(tmp_path):
    exp, meta = fixture("dflash")
    d = _copy(tmp_path, "dflash")
    state = load_file(str(d / "model.safetensors"))
    state["embed_tokens.weight"], state["lm_head.weight"] = exp["embed"], exp["lm_head"]
    save_file(state, str(d / "model.safetensors"))
    model = load_dflash(d, device="cpu", dtype=torch.float32)
    assert model.use_own_head and model.use_own_embedding and model.d2t is None
    h = run_steps(model, exp, meta)[1]  # no embed= needed: the checkpoint carries its own copy
    assert (h[0] - exp["hidden_1"]).abs().max() <= ATOL
    assert (model.logits(model.slot_hidden(h))[0] - exp["logits_1"]).abs().max() <= ATOL
    state["lm_head.weight"] = exp["lm_head"][:50].contiguous()
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="d2t"):
        load_dflash(d, device="cpu")


def test_speculators_dflash_sample_from_anchor(tmp_path):
    d = _spec_dflash(tmp_path)
    _edit(d, sample_from_anchor=True)
    model = load_dflash(d, device="cpu", dtype=torch.float32)
    assert model.anchor_first and model.num_draft_slots == 4
    assert model.slot_hidden(torch.zeros(2, 4, 32)).shape == (2, 4, 32)


@pytest.mark.parametrize("name", ["dflash", "dspark_vanilla"])
def test_draft_rows_are_one_contiguous_block(name):
    """The rows the LM head reads come out contiguous for every batch and K: a strided [R, K, H]
    input makes torch run the head once per request, reading its weights R times."""
    model = load(name)
    hidden = torch.randn(3, model.block_size, 8)
    for k in (None, 1, model.num_draft_slots - 1):
        rows = model.slot_hidden(hidden, k)
        first = 0 if model.anchor_first else 1
        width = model.num_draft_slots if k is None else k
        assert rows.is_contiguous() and torch.equal(rows, hidden[:, first : first + width])


def test_recorded_acceptance_is_read_beside_the_weights_and_starts_the_policy(tmp_path):
    """A checkpoint's acceptance.json (written by the trainer's export) reaches the draft-length policy;
    one that is not a non-increasing list of probabilities is refused with its path and the rule."""
    from blockspec import LLM
    from blockspec.drafters.formats import ACCEPTANCE_FILE, write_recorded_acceptance

    from factories import save_drafter_target

    drafter = tmp_path / "dflash"
    shutil.copytree(FIX / "dflash", drafter)
    assert load_dflash(drafter, device="cpu").recorded_acceptance is None
    write_recorded_acceptance(drafter, [0.8, 0.4, 0.1], "test")
    assert load_dflash(drafter, device="cpu").recorded_acceptance == (0.8, 0.4, 0.1)
    target = save_drafter_target(tmp_path / "target")
    llm = LLM(str(target), device="cpu", speculative_config={"method": "dflash", "model": str(drafter)})
    assert llm.engine.policy.recorded_rates == [0.8, 0.5, 0.25]
    for bad in ([0.4, 0.8], [1.5], [], "0.8"):
        (drafter / ACCEPTANCE_FILE).write_text(json.dumps({"prefix_acceptance": bad}))
        with pytest.raises(ModelLoadError, match="acceptance.json: prefix_acceptance must be a non-increasing"):
            load_dflash(drafter, device="cpu")


def dspark_with_target_copies(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A tiny target and a DeepSpec DSpark carrying copies of its embedding and LM head, as exports do."""
    from factories import save_drafter_target

    target = save_drafter_target(tmp_path / "target")
    tw = load_file(str(target / "model.safetensors"))
    drafter = tmp_path / "dspark"
    shutil.copytree(FIX / "dspark_vanilla", drafter)
    weights = load_file(str(drafter / "model.safetensors"))
    weights["embed_tokens.weight"] = tw["model.embed_tokens.weight"].clone()
    weights["lm_head.weight"] = tw.get("lm_head.weight", tw["model.embed_tokens.weight"]).clone()
    save_file(weights, str(drafter / "model.safetensors"))
    return target, drafter, weights


def greedy_dspark_run(target: Path, drafter: Path) -> tuple[bool, list[int], list[int]]:
    """(whether the drafter keeps its own head, greedy output ids, accepted drafts by position)."""
    from blockspec import LLM, SamplingParams

    spec = {"method": "dspark", "model": str(drafter), "adaptive_draft_length": False}
    llm = LLM(str(target), device="cpu", dtype="float32", seed=0, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ids = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0].token_ids
    return llm.engine.proposer.drafter.use_own_head, list(ids), llm.get_stats()["num_accepted_tokens_per_pos"]


def test_a_drafter_carrying_copies_of_the_target_vocab_shares_them_with_the_same_drafts(tmp_path):
    """DeepSpec exports carry copies of the target's embedding and LM head. Bitwise copies are dropped for
    the target's own (one copy in memory) and the greedy drafts and outputs stay the same; a copy that
    differs in one element is kept."""
    from blockspec import LLM

    target, drafter, weights = dspark_with_target_copies(tmp_path)

    def run() -> tuple[bool, list[int], list[int]]:
        return greedy_dspark_run(target, drafter)

    own, shared_ids, shared_acc = run()
    assert not own
    keep = DraftModel.share_target_copies
    DraftModel.share_target_copies = lambda self, target: None  # the control: the drafter keeps its copies
    try:
        assert run() == (True, shared_ids, shared_acc)
    finally:
        DraftModel.share_target_copies = keep
    weights["lm_head.weight"][3, 2] += 1.0
    save_file(weights, str(drafter / "model.safetensors"))
    spec = {"method": "dspark", "model": str(drafter)}
    d = LLM(str(target), device="cpu", dtype="float32", seed=0, speculative_config=spec).engine.proposer.drafter
    assert d.use_own_head and not d.use_own_embedding


def test_stripping_the_target_copies_keeps_the_drafts_and_restoring_gives_the_reference_file(tmp_path):
    """The shipped DSpark leaves out its copies of the target's embedding and head: the same drafts and output
    without them, and `restore_target_copies` writes back the tensors the reference code reads."""
    target, drafter, weights = dspark_with_target_copies(tmp_path)
    with_copies = greedy_dspark_run(target, drafter)
    vocab, hidden = weights["embed_tokens.weight"].shape
    item = weights["embed_tokens.weight"].element_size()
    assert strip_target_copies(drafter, target) == 2 * vocab * hidden * item
    stripped = load_file(str(drafter / "model.safetensors"))
    assert not set(TARGET_COPIES) & set(stripped)
    assert greedy_dspark_run(target, drafter)[1:] == with_copies[1:]
    assert strip_target_copies(drafter, target) == 0  # nothing left to drop
    out = restore_target_copies(drafter, target, tmp_path / "restored")
    restored = load_file(str(out / "model.safetensors"))
    assert sorted(restored) == sorted(weights)
    assert all(torch.equal(restored[k], weights[k]) for k in weights)
    assert (out / "config.json").read_text() == (drafter / "config.json").read_text()


def test_stripping_refuses_a_drafter_whose_own_head_differs_from_the_target(tmp_path):
    target, drafter, weights = dspark_with_target_copies(tmp_path)
    weights["lm_head.weight"][3, 2] += 1.0
    save_file(weights, str(drafter / "model.safetensors"))
    before = (drafter / "model.safetensors").read_bytes()
    with pytest.raises(ModelLoadError, match=r"lm_head\.weight differs from the target's"):
        strip_target_copies(drafter, target)
    assert (drafter / "model.safetensors").read_bytes() == before
    with pytest.raises(ModelLoadError, match="not a DeepSpec DSpark checkpoint"):
        strip_target_copies(FIX / "dflash", target)
