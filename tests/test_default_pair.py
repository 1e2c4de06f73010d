"""The shipped embedded pair keeps its drafting quality: held-out greedy acceptance above a floor.

The prompts are openings of functions from stdlib packages no training run saw; decoding is
greedy, so the figure is deterministic. The floors sit below the measured values (DFlash 2.24,
DSpark 3.02 on this set) with room for numerical noise, and far above what a drafter cut off from the
target's features gives (1.02 / 1.03, the negative control below).
"""

from __future__ import annotations

import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.assets import PAIR
from blockspec.demo import heldout_prompts

FLOORS = {"dflash": 2.0, "dspark": 2.7}
needs_pair = pytest.mark.skipif(not (PAIR / "target" / "config.json").is_file(), reason="embedded pair not installed")


def acceptance(method: str, drop_features: bool = False) -> tuple[float, bool]:
    """Held-out mean acceptance length, and whether the output equals plain decoding."""
    llm = LLM(str(PAIR / "target"), device="cpu", seed=0, speculative_config={
        "method": method, "model": str(PAIR / method), "adaptive_draft_length": False})
    if drop_features:  # the drafter no longer sees the target's hidden states
        with torch.no_grad():
            llm.engine.proposer.drafter.fc.weight.zero_()
    prompts = heldout_prompts(6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True,
                                                 use_speculation=False), use_tqdm=False)
    same = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    return llm.get_stats()["mean_acceptance_length"], same


@needs_pair
@pytest.mark.parametrize("method", sorted(FLOORS))
def test_heldout_acceptance_stays_above_floor(method):
    length, same = acceptance(method)
    assert same
    assert length >= FLOORS[method], f"{method} held-out acceptance length {length:.2f} < {FLOORS[method]}"


@needs_pair
@pytest.mark.parametrize("method", sorted(FLOORS))
def test_floor_catches_a_drafter_cut_off_from_the_target_features(method):
    length, same = acceptance(method, drop_features=True)
    assert same and length < FLOORS[method]


@needs_pair
def test_shipped_dspark_leaves_its_vocab_to_the_target_and_restores_to_the_deepspec_file(tmp_path):
    """The shipped DSpark has no copies of the target's embedding and head (they would double the pair's
    vocabulary bytes); restored, they are the target's rows in the drafter's dtype, as DeepSpec files hold."""
    from safetensors.torch import load_file

    from blockspec.drafters import load_dspark, restore_target_copies
    from blockspec.drafters.formats import TARGET_COPIES

    shipped = load_file(str(PAIR / "dspark" / "model.safetensors"))
    assert not set(TARGET_COPIES) & set(shipped)
    restored = load_file(str(restore_target_copies(PAIR / "dspark", PAIR / "target", tmp_path) / "model.safetensors"))
    embed = load_file(str(PAIR / "target" / "model.safetensors"))["model.embed_tokens.weight"]
    for name in TARGET_COPIES:
        assert torch.equal(restored[name], embed.to(restored[name].dtype))
    assert load_dspark(tmp_path, device="cpu").use_own_embedding
