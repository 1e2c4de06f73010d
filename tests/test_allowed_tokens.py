"""allowed_token_ids and truncate_prompt_tokens (vLLM's SamplingParams fields).

allowed_token_ids: only the listed tokens are emitted, and speculation keeps plain decoding's output. The
oracle drafter proposes a token outside the list at a draft position, so only the verify row's mask keeps
it out; a control whose verify rows ignore the list lets it through."""

from __future__ import annotations

import pytest

from blockspec import LLM, SamplingError, SamplingParams
from blockspec.engine.batch import BatchSampling
from test_spec import add_oracle, spec_llm
from test_structured import plain, target  # noqa: F401  (fixtures: the tokenized tiny target, plain LLM)

K = 3  # drafts per step: with every draft accepted, output index i is a draft where i % (K + 1) != 0
PROMPTS = ["def main():", "import os\n", "class A:"]


def generate(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 7}], ids=["greedy", "seeded"])
def test_speculation_emits_only_the_allowed_tokens_as_plain_decoding_does(target, plain, sampling, monkeypatch):
    base = dict(max_tokens=32, ignore_eos=True, **sampling)
    free = generate(plain, SamplingParams(**base))
    # each output's request forbids a token it held at a draft position and not before
    at = [next(i for i in range(1, len(out)) if i % (K + 1) and out[i] not in out[:i]) for out in free]
    banned = [out[i] for out, i in zip(free, at)]
    vocab = plain.engine.vocab_size
    params = [SamplingParams(**base, allowed_token_ids=[t for t in range(vocab) if t != b]) for b in banned]
    want = generate(plain, params)
    assert all(out[:i] == free_out[:i] and b not in out for out, free_out, i, b in zip(want, free, at, banned))

    # the oracle drafts the allowed output but for the banned token, where the free output had it
    drafts = [out[:i] + [b] + out[i + 1:] for out, i, b in zip(want, at, banned)]
    llm = spec_llm(target, "dflash", "dflash", num_speculative_tokens=K)
    tok = plain.get_tokenizer()
    add_oracle(llm, {tuple(tok.encode(p)): d for p, d in zip(PROMPTS, drafts)}, corrupt=0.0)
    assert generate(llm, params) == want
    assert llm.get_stats()["mean_acceptance_length"] > 2.0  # drafts were accepted around the banned one

    monkeypatch.setattr(BatchSampling, "_allowed", lambda self, reqs, rows, drafts, ends: self._grammar_masks(reqs, rows,
                                                                                                        drafts))
    broken = generate(llm, params)
    assert broken != want and any(b in out for out, b in zip(broken, banned))


def test_truncate_prompt_tokens_keeps_the_last_tokens(plain):
    """The output of a prompt truncated to its last k tokens is that of those k tokens given alone; -1 keeps
    what fits beside one output token; a k the context cannot hold is refused by name."""
    tok = plain.get_tokenizer()
    ids = tok.encode("def main():\n    return helper(1, 2)\n")
    base = dict(temperature=0, max_tokens=8, ignore_eos=True)
    [cut] = plain.generate({"prompt_token_ids": ids}, SamplingParams(**base, truncate_prompt_tokens=5),
                           use_tqdm=False)
    [alone] = plain.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(**base), use_tqdm=False)
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    limit = plain.engine.config.max_model_len
    long = (ids * limit)[: limit + 20]
    one = SamplingParams(**{**base, "max_tokens": 1}, truncate_prompt_tokens=-1)
    [fits] = plain.generate({"prompt_token_ids": long}, one, use_tqdm=False)
    assert fits.prompt_token_ids == long[-(limit - 1):] and len(fits.outputs[0].token_ids) == 1
    with pytest.raises(Exception, match=rf"truncate_prompt_tokens={limit} leaves no room .* 1\.\.{limit - 1}"):
        plain.generate({"prompt_token_ids": ids}, SamplingParams(**base, truncate_prompt_tokens=limit), use_tqdm=False)


@pytest.mark.parametrize("field, value", [("allowed_token_ids", []), ("allowed_token_ids", [-1]),
                                          ("allowed_token_ids", [1.5]), ("truncate_prompt_tokens", 0),
                                          ("truncate_prompt_tokens", -2), ("truncate_prompt_tokens", True)])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(SamplingError, match=rf"^SamplingParams\.{field}=.* is invalid; allowed: "):
        SamplingParams(**{field: value})


def test_allowed_ids_outside_the_vocabulary_are_refused(plain):
    vocab = plain.engine.vocab_size
    with pytest.raises(SamplingError, match=rf"allowed_token_ids has token ids \[{vocab}\] outside the vocabulary"):
        plain.generate("x", SamplingParams(allowed_token_ids=[1, vocab]), use_tqdm=False)
