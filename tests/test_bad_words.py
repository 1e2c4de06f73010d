"""bad_words (vLLM's): a banned word is never emitted, and speculation bans it exactly where plain decoding
does. The drafts of an oracle drafter propose the banned continuation, so the ban of verify rows that
follow drafts is what keeps it out; a control without the drafts in that ban lets it through."""

from __future__ import annotations

import pytest

from blockspec import LLM, SamplingError, SamplingParams
from blockspec.bad_words import banned_tokens, word_sequences
from blockspec.engine import batch
from factories import save_drafter_target, save_tiny_tokenizer
from test_spec import add_oracle, spec_llm
from test_structured import plain, target  # noqa: F401  (fixtures: the tokenized tiny target, plain LLM)

K = 3  # drafts per step: with every draft accepted, output index i is a draft where i % (K + 1) != 0


PROMPTS = ["def main():", "import os\n", "class A:"]


def contains(seq: list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(part)]) == part for i in range(len(seq) - len(part) + 1))


def pair_words(tokenizer, outputs: list[list[int]]) -> list[tuple[str, tuple[int, int]]]:
    """For each output, a two-token word it holds whose first token is a draft when all drafts are accepted
    (so the row that would emit its second token follows a draft): (the word, its tokens)."""
    words = []
    for out in outputs:
        for i in range(1, len(out) - 1):
            word = tokenizer.decode(out[i : i + 2])
            if i % (K + 1) and word.strip() == word and len(word) == 2 and \
                    word_sequences([word], tokenizer, 96) == (tuple(out[i : i + 2]),):
                words.append((word, (out[i], out[i + 1])))
                break
    assert len(words) == len(outputs)
    return words


def generate(llm: LLM, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "launched-ahead"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_speculation_bans_what_plain_decoding_bans(target, plain, sampling, ahead, monkeypatch):
    """Plain decoding never emits a two-token bad word its unbanned output held, nor a one-token one; a
    speculative engine whose drafts propose the banned word gives the same tokens (its steps launched
    ahead of their commit or not); with verify rows banned from the committed output alone (drafts
    ignored), it emits the banned word."""
    base = dict(max_tokens=36, ignore_eos=True, **sampling)
    free = generate(plain, [SamplingParams(**base)] * len(PROMPTS))
    tok = plain.get_tokenizer()
    pairs = pair_words(tok, free)
    single = free[0][5]  # a one-token word of the first prompt's output, banned everywhere
    params = [SamplingParams(**base, bad_words=[word] + ([tok.decode([single])] if i == 0 else []))
              for i, (word, _) in enumerate(pairs)]
    want = generate(plain, params)
    for out, free_out, (_, pair) in zip(want, free, pairs):
        assert contains(free_out, pair) and not contains(out, pair) and out != free_out
    assert single not in want[0]

    # the oracle drafts the banned output, but for the banned word's second token where its first came before
    drafts = []
    for out, free_out, (_, pair) in zip(want, free, pairs):
        at = next(i for i in range(len(free_out)) if tuple(free_out[i - 1 : i + 1]) == pair)
        drafts.append(out[:at] + [pair[1]] + out[at + 1:])
    llm = spec_llm(target, "dflash", "dflash", num_speculative_tokens=K)
    llm.engine.async_scheduling = ahead
    add_oracle(llm, {tuple(tok.encode(p)): e for p, e in zip(PROMPTS, drafts)}, corrupt=0.0)
    assert generate(llm, params) == want
    assert llm.get_stats()["mean_acceptance_length"] > 3.0  # drafts were accepted up to the banned word

    monkeypatch.setattr(batch, "banned_tokens", lambda words, output, drafts=(): banned_tokens(words, output))
    broken = generate(llm, params)
    assert broken != want and any(contains(out, pair) for out, (_, pair) in zip(broken, pairs))


def test_one_token_words_keep_plain_steps_pipelined_and_exact(target, plain):
    """A one-token ban reads no history, so plain steps are still launched ahead of their commit; their
    tokens are the synchronous steps'."""
    tok = plain.get_tokenizer()
    free = generate(plain, [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=[tok.decode([free[1][3]])])
    want = generate(plain, [params] * len(PROMPTS))
    assert free[1][3] not in want[1]
    engine = LLM(str(target), device="cpu", max_model_len=160).engine
    engine.async_scheduling = True
    pipelined, real = [], engine._plain_step_pipelined
    engine._plain_step_pipelined = lambda reqs: pipelined.append(len(reqs)) or real(reqs)
    reqs = [engine.add_request(str(i), p, tok.encode(p), params)[0] for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in reqs] == want and len(pipelined) > 10


def test_banned_tokens_follow_the_history():
    words = ((5,), (7, 8), (1, 2, 3))
    assert banned_tokens(words, []) == [5]
    assert banned_tokens(words, [4, 7]) == [5, 8]
    assert banned_tokens(words, [4], [7]) == [5, 8]  # the draft before the row completes the prefix
    assert banned_tokens(words, [1], [2]) == [5, 3] and banned_tokens(words, [9, 1, 2], []) == [5, 3]
    assert banned_tokens(words, [1, 2], [9]) == [5]


def test_words_tokenize_bare_and_after_a_space(target, plain):
    """Leading whitespace is dropped; a word whose spaced form is another sequence of the same length is
    banned in both forms (the character tokenizer spells the space as a token of its own: one form)."""
    tok = plain.get_tokenizer()
    assert word_sequences(["ab", "  ab", "c"], tok, 96) == (tuple(tok.encode("ab")), tuple(tok.encode("c")))

    class Words:  # a word-level tokenizer: "ab" and " ab" are one token each
        def encode(self, text, add_special_tokens=False):
            return {"ab": [10], " ab": [11], "x y": [12, 13], " x y": [14, 15, 13]}[text]

    assert word_sequences(["ab", "x y"], Words(), 96) == ((10,), (11,), (12, 13))


@pytest.mark.parametrize("value", ["ab", [""], ["  "], [1], ["a"] * 129, ("a", None)])
def test_invalid_bad_words_name_the_field(value):
    with pytest.raises(SamplingError, match=r"^SamplingParams\.bad_words=.* is invalid; allowed: None or a list"):
        SamplingParams(bad_words=value)


def test_words_the_model_cannot_spell_are_refused(tmp_path, target, plain):
    with pytest.raises(SamplingError, match=r"SamplingParams\.bad_words\[1\]='é' tokenizes to no tokens"):
        plain.generate("ab", SamplingParams(bad_words=["ab", "é"]), use_tqdm=False)
    with pytest.raises(SamplingError, match=r"bad_words\[0\] is not valid Unicode"):
        plain.generate("ab", SamplingParams(bad_words=["\ud800"]), use_tqdm=False)
    with pytest.raises(SamplingError, match=r"bad_words tokenize to 1100 tokens .*; at most 1024 are allowed"):
        plain.generate("ab", SamplingParams(bad_words=["a" * 600, "b" * 500]), use_tqdm=False)
    wide = save_drafter_target(tmp_path / "wide")  # its 96 ids, and a tokenizer of 98 ("~" is 96)
    save_tiny_tokenizer(wide)
    llm = LLM(str(wide), device="cpu", max_model_len=64)
    with pytest.raises(SamplingError, match=r"bad_words tokenize to ids \[96\] outside the vocabulary \[0, 96\)"):
        llm.generate("ab", SamplingParams(bad_words=["~"]), use_tqdm=False)
    bare = LLM(str(save_drafter_target(tmp_path / "bare")), device="cpu", max_model_len=64)  # no tokenizer
    with pytest.raises(SamplingError, match=r"bad_words needs the model's tokenizer"):
        bare.generate({"prompt_token_ids": [3, 4]}, SamplingParams(bad_words=["ab"]), use_tqdm=False)
