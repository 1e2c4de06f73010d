"""prompt_logprobs (vLLM's): every prompt token's logprob given the tokens before it, with its rank and the
top-k alternatives, equal to a forward of the reference model over the prompt, whether the prompt is
prefilled whole, in chunks, or again after a preemption (and then computed once)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockspec import LLM, SamplingError, SamplingParams
from blockspec.engine import batch
from factories import save_drafter_target

LENGTHS = (1, 2, 9, 23, 41)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def reference(target):
    """log_softmax of the transformers model's logits over a prompt: [len, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs


def prompts(lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 95, (n,), generator=g).tolist() for n in lengths]


def assert_matches(entries, ids: list[int], ref: torch.Tensor, k: int) -> None:
    """One entry per prompt token (None first): the token's logprob and rank, then the k most likely
    tokens ranked 1..k, all as the reference forward has them."""
    assert len(entries) == len(ids) and entries[0] is None
    for t in range(1, len(ids)):
        row, tok, entry = ref[t - 1], ids[t], entries[t]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert 1 + int((row > row[tok] + 1e-4).sum()) <= entry[tok].rank <= 1 + int((row > row[tok] - 1e-4).sum())
        top = row.topk(k)
        alternatives = sorted((lp.rank, t_) for t_, lp in entry.items() if t_ != tok or lp.rank <= k)
        assert [r for r, _ in alternatives] == list(range(1, k + 1))
        assert [t_ for _, t_ in alternatives] == top.indices.tolist()
        assert all(abs(entry[t_].logprob - v) < 1e-4 for t_, v in zip(top.indices.tolist(), top.values.tolist()))
        assert set(entry) == {tok, *top.indices.tolist()}


@pytest.mark.parametrize("max_prefill_tokens", [4096, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_a_forward_over_the_prompt(target, reference, max_prefill_tokens):
    """Prompts of several lengths in one batch (with small chunks, a prompt spans several prefill forwards
    and shares them with others); n copies of a prompt share its entries; the outputs are unchanged."""
    llm = LLM(str(target), device="cpu", max_model_len=96, max_prefill_tokens=max_prefill_tokens)
    ps = prompts()
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
              for k in (0, 3, 1, 5, 2)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for out, ids, p in zip(outs, ps, params):
        assert_matches(out.prompt_logprobs, ids, reference(ids), p.prompt_logprobs)
    plain = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(temperature=0, max_tokens=3,
                                                                              ignore_eos=True), use_tqdm=False)
    assert [o.outputs for o in plain] == [o.outputs for o in outs] and plain[0].prompt_logprobs is None
    two = llm.generate({"prompt_token_ids": ps[3]}, SamplingParams(n=2, temperature=1, seed=1, max_tokens=3,
                                                                   prompt_logprobs=2), use_tqdm=False)[0]
    assert len(two.outputs) == 2
    assert_matches(two.prompt_logprobs, ps[3], reference(ps[3]), 2)


def test_preempted_requests_keep_their_prompt_logprobs_and_compute_them_once(target, reference, monkeypatch):
    """KV pages for about one sequence, four requests that grow long, prompts prefilled in chunks: the
    newest are preempted and recomputed, some more than once. Every request's prompt logprobs equal the
    reference's, and each prompt position's logits were taken once."""
    rows = []
    real = batch.entries

    def counted(scores, tokens, tops, *args, **kwargs):
        rows.append(len(tops))
        return real(scores, tokens, tops, *args, **kwargs)

    monkeypatch.setattr(batch, "entries", counted)
    llm = LLM(str(target), device="cpu", max_model_len=160, max_prefill_tokens=16, num_kv_pages=12, kv_page_size=16)
    ps = prompts((30, 45, 20, 38), seed=3)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] >= 2
    for out, ids in zip(outs, ps):
        assert_matches(out.prompt_logprobs, ids, reference(ids), 2)
    assert sum(rows) == sum(len(p) - 1 for p in ps)


@pytest.mark.parametrize("value", [-2, 1.0, "2"])
def test_invalid_prompt_logprobs_name_the_field(value):
    with pytest.raises(SamplingError, match=r"^SamplingParams\.prompt_logprobs=.* is invalid; allowed: None or an"):
        SamplingParams(prompt_logprobs=value)
