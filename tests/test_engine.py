"""Engine behaviour through the public API: exact greedy, seeded sampling, stops, logprobs, bad input."""

from __future__ import annotations

import functools
import json
import logging

import pytest
import torch
import transformers

from blockspec import LLM, SamplingError, SamplingParams
from blockspec.config import ConfigError, SpeculativeConfig
from blockspec.engine.batch import entries
from blockspec.errors import RequestError
from factories import FAIL_PROMPT, FAMILIES, llm_with_faults, save_tiny, save_tiny_model_with_tokenizer


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding: full forward each step, argmax of transformers' logits."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_64_tokens_batched(tmp_path, family):
    path = save_tiny(tmp_path / family, family, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", max_model_len=256)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 96, (n,), generator=g).tolist() for n in (3, 17, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 64)
        assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("m"), "qwen3", seed=7)
    return LLM(str(path), device="cpu", max_model_len=192, max_num_seqs=8)


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("def main():", params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=n, ignore_eos=True) for s, n in ((1, 5), (2, 30))]
    batch = llm.generate(["x = 1", "def main():", "import os\n"], [others[0], params, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate("def main():", different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy_and_n_copies_differ(llm):
    greedy = llm.generate("class A:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    topk1 = llm.generate("class A:", SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert greedy[0].outputs[0].token_ids == topk1[0].outputs[0].token_ids
    many = llm.generate("class A:", SamplingParams(n=3, temperature=1.5, seed=3, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(many.outputs) == 3 and len({tuple(o.token_ids) for o in many.outputs}) > 1


def test_stops_and_lengths(llm):
    base = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids, text = base.outputs[0].token_ids, base.outputs[0].text
    assert len(ids) == 40
    # stop token id: output ends at its first occurrence, token included
    stop_id = ids[5]
    out = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ids[: ids.index(stop_id) + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    # ... its text only with include_stop_str_in_output (vLLM's rule); an EOS stop likewise, with no stop_reason
    k = ids.index(stop_id)
    decode = functools.partial(llm.tokenizer.decode, skip_special_tokens=True)
    assert out.outputs[0].text == decode(ids[:k]) != decode(ids[: k + 1])
    shown = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id],
                                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert shown.token_ids == ids[: k + 1] and shown.text == decode(ids[: k + 1])
    # the tokenizer's EOS stops with no stop_reason; another EOS id (generation_config's) names itself, as vLLM's
    # stop_token_ids from generation_config do
    output = llm.engine.output
    eos_ids, primary = output.eos_ids, output.primary_eos
    try:
        for output.primary_eos, reason in ((stop_id, None), (primary, stop_id)):
            output.eos_ids = [stop_id]
            eos = llm.generate("a", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
            assert (eos.token_ids, eos.text, eos.finish_reason, eos.stop_reason) == (
                ids[: k + 1], decode(ids[:k]), "stop", reason)
    finally:
        output.eos_ids, output.primary_eos = eos_ids, primary
    # stop string: text cut before it (or kept with include_stop_str_in_output)
    needle = text[10:13]
    cut = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, stop=[needle]), use_tqdm=False)[0]
    assert cut.outputs[0].text == text[: text.index(needle)] and cut.outputs[0].finish_reason == "stop"
    kept = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, stop=needle,
                                            include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[: text.index(needle) + len(needle)]
    # a stop string completed before min_tokens stops nothing later, whatever other strings are listed (a
    # longer one widened the search over text older than the newest token for every string)
    once = next(text[i:i + 3] for i in range(len(text) - 3) if text.count(text[i:i + 3]) == 1)
    done = next(m for m in range(1, 41) if once in decode(ids[:m]))
    for stops in ([once], [once, "a stop string this output never holds"]):
        late = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, min_tokens=done + 1, stop=stops,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert (late.token_ids, late.finish_reason) == (ids, "length"), stops


def test_eos_and_min_tokens(llm):
    bias = {1: 100.0}  # make EOS (id 1) the argmax everywhere
    out = llm.generate("a", SamplingParams(temperature=0, max_tokens=20, logit_bias=bias), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [1] and out.outputs[0].finish_reason == "stop"
    out = llm.generate("a", SamplingParams(temperature=0, max_tokens=20, min_tokens=6, logit_bias=bias),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7 and 1 not in out.outputs[0].token_ids[:6]
    out = llm.generate("a", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias=bias),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [1] * 5 and out.outputs[0].finish_reason == "length"


def reference_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The target's logits over `ids` in one dense forward: [len, vocab]."""
    from blockspec.models.kv_cache import dense_causal_meta

    model = llm.model
    return model.compute_logits(model(torch.tensor([ids]), dense_causal_meta(1, len(ids), "cpu"), None)[0])[0]


def test_logprobs_are_the_raw_distribution(llm):
    out = llm.generate("def", SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    ref = torch.log_softmax(reference_logits(llm, out.prompt_token_ids + c.token_ids), -1)
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(out.prompt_token_ids) - 1 + i]
        assert abs(entry[tok].logprob - float(row[tok])) < 1e-4 and entry[tok].rank == 1
        assert len(entry) == 3  # greedy token is also the top-1
        assert set(entry) == set(row.topk(3).indices.tolist())
        assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in entry.items())  # vLLM's field


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs"])
def test_logprobs_mode(tmp_path, mode):
    """vLLM's logprobs_mode at T = 0.5 with top_k 4: the raw logits' log_softmax (the default, unchanged by
    temperature or top-k), the raw logits, or the log_softmax of logits / 0.5 over the top 4 (-inf elsewhere)."""
    path = save_tiny(tmp_path / "m", "llama")
    llm = LLM(str(path), device="cpu", logprobs_mode=mode, max_model_len=64)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.5, top_k=4, seed=1,
                       max_tokens=4, logprobs=6, ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    logits = reference_logits(llm, out.prompt_token_ids + c.token_ids)[2:-1]
    top4 = logits.topk(4, dim=-1).indices
    want = {"raw_logprobs": torch.log_softmax(logits, -1), "raw_logits": logits,
            "processed_logprobs": torch.log_softmax(torch.full_like(logits, float("-inf")).scatter(
                1, top4, logits.gather(1, top4) / 0.5), -1)}[mode]
    for row, tok, entry in zip(want, c.token_ids, c.logprobs):
        assert abs(entry[tok].logprob - float(row[tok])) < 1e-4
        assert all(abs(lp.logprob - float(row[t])) < 1e-4 or lp.logprob == float(row[t]) == float("-inf")
                   for t, lp in entry.items())
    assert abs(c.cumulative_logprob - sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs))) < 1e-4
    assert all(lp.decoded_token is None for e in c.logprobs for lp in e.values())  # this checkpoint has no tokenizer


def test_chat_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    expect = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    expect = expect if isinstance(expect, list) else expect["input_ids"]
    assert out[0].prompt_token_ids == list(expect)


def test_chat_content_parts_are_their_texts(llm):
    """OpenAI content parts reach the template as their texts joined by newlines, as vLLM's LLM.chat and
    the server give them (not as the list's Python repr); a part that is not text is refused by name."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    params = SamplingParams(temperature=0, max_tokens=2)
    got = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    want = llm.chat([{"role": "user", "content": "hi\nthere"}], params, use_tqdm=False)
    assert got[0].prompt_token_ids == want[0].prompt_token_ids
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with pytest.raises(RequestError, match=r"conversation 0, message 1, content part 1: 'image_url' parts are not"):
        llm.chat([{"role": "system", "content": "s"}, {"role": "user", "content": [parts[0], image]}], params,
                 use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-2), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"), (dict(n=0), "n"),
    # bools are not counts (but vLLM's logprobs=True, which is 1), values must fit the device's int64 seeds and
    # the float32 logits a bias is added to
    (dict(n=True), "n"), (dict(max_tokens=True), "max_tokens"), (dict(logprobs=1.0), "logprobs"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(logit_bias={5: 1e308}), "logit_bias"),
    (dict(logit_bias={"abc": 1}), "logit_bias"), (dict(logit_bias={-1: 5}), "logit_bias"), (dict(stop=123), "stop"),
    (dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=1.5), "seed"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(top_k=True), "top_k"),
    # vLLM's: best_of other than n (V1 dropped it), stop strings without the text they are found in
    (dict(best_of=2), "best_of"), (dict(n=2, best_of=1), "best_of"), (dict(detokenize=1), "detokenize"),
    (dict(stop="x", detokenize=False), "stop"),
])
def test_invalid_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingError, match=rf"SamplingParams\.{field}=.*allowed"):
        SamplingParams(**kwargs)


def test_a_tiny_temperature_samples_at_one_hundredth_and_greedy_takes_one_copy(llm, caplog):
    """logits / 1e-39 overflow float32 (the request used to fail with non-finite logits): vLLM raises a positive
    temperature below 0.01 to 0.01, with a warning, and only 0 is greedy; so does blockspec (it took anything
    under 1e-5 as greedy). Greedy sampling takes n = 1 (vLLM's rule: its copies would all be the same)."""
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        for t in (1e-45, 1e-39, 1e-20, 9.9e-3):
            params = SamplingParams(temperature=t, max_tokens=6, seed=1)
            assert not params.greedy and params.temperature == 0.01
            out = llm.generate(["ab"], params, use_tqdm=False)[0].outputs[0]
            assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert sum("is below 0.01" in r.getMessage() for r in caplog.records) == 4
    assert SamplingParams(temperature=0.01).temperature == 0.01
    with pytest.raises(SamplingError, match=r"SamplingParams\.n=3 is invalid; allowed: 1 with greedy sampling"):
        SamplingParams(temperature=0, n=3)


def test_sampling_conventions_follow_vllms(llm):
    """vLLM's conventions, each of which blockspec read otherwise: a stop string counts only where it ends in text
    after the min_tokens-th token; copy i of a seeded n > 1 request samples with seed + i (copy 0 is the request
    alone); a sampled token tied with a better-ranked one ranks after it; stop, stop_token_ids and bad_words are
    lists; repetition_penalty is any positive number, logit_bias any finite one (from_optional clamps to OpenAI's
    [-100, 100])."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = llm.generate("a", greedy, use_tqdm=False)[0].outputs[0]
    needle = llm.get_tokenizer().decode(base.token_ids[:2])  # a stop string the 2nd token completes, once
    assert needle and base.text.count(needle) == 1

    def stopped(min_tokens: int) -> list[int]:
        return llm.generate("a", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[needle],
                                                min_tokens=min_tokens), use_tqdm=False)[0].outputs[0].token_ids

    assert stopped(1) == base.token_ids[:2] and stopped(2) == base.token_ids
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    copies = llm.generate("a", SamplingParams(n=2, seed=42, **sampled), use_tqdm=False)[0].outputs
    for i, copy in enumerate(copies):
        alone = llm.generate("a", SamplingParams(seed=42 + i, **sampled), use_tqdm=False)[0].outputs[0]
        assert copy.token_ids == alone.token_ids, i
    scores = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    ranked = entries(scores, torch.tensor([2]), [2])[0]
    assert ranked[2].rank == 2 and ranked[1].rank == 1  # token 2 ties token 1, which topk lists first
    p = SamplingParams(stop="x", repetition_penalty=20.0, logit_bias={5: 150.0})
    assert (p.stop, p.stop_token_ids, p.bad_words, p.logit_bias) == (["x"], [], [], {5: 150.0})
    q = SamplingParams.from_optional(temperature=None, top_p=None, logit_bias={5: 150.0, 6: -300.0}, max_tokens=None)
    assert (q.temperature, q.top_p, q.logit_bias, q.max_tokens) == (1.0, 1.0, {5: 100.0, 6: -100.0}, None)


def test_bad_requests_fail_before_any_work(llm):
    good = SamplingParams(max_tokens=4)
    with pytest.raises(RequestError, match="prompt 1: the prompt is empty"):
        llm.generate(["ok", ""], good, use_tqdm=False)
    with pytest.raises(RequestError, match=r"prompt has \d+ tokens; at most 191 fit \(max_model_len 192 less one"):
        llm.generate(["ok", "x" * 400], good, use_tqdm=False)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [5, 999]}], good, use_tqdm=False)
    with pytest.raises(SamplingError, match="stop_token_ids"):
        llm.generate(["ok"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ConfigError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["ok"], [good, good], use_tqdm=False)
    for prompts in (None, 123):
        with pytest.raises(RequestError, match="prompts must be a string, a dict with 'prompt_token_ids', or a list"):
            llm.generate(prompts, good, use_tqdm=False)
    with pytest.raises(RequestError, match="prompt 0: not valid Unicode: a lone surrogate"):
        llm.generate(["abc \ud800"], good, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.generate("ok", good, use_tqdm=False)[0].outputs[0].token_ids  # engine still serves


def test_sampling_params_changed_after_construction_are_checked_before_any_work(llm):
    """SamplingParams is mutable (as vLLM's is): a field set to a bad value after construction ran
    unchecked (n=0 ran every other prompt, then lost their outputs in an IndexError; max_tokens=0 and
    temperature=-1 decoded) and a new stop was ignored. generate() checks each one up front, naming its
    prompt, and honours the change."""
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    generated = llm.engine.num_generated
    for field, value in (("n", 0), ("max_tokens", 0), ("temperature", -1.0), ("logprobs", -2)):
        bad = SamplingParams(temperature=0, max_tokens=6)
        setattr(bad, field, value)
        with pytest.raises(SamplingError, match=rf"prompt 1: SamplingParams\.{field}=.*allowed"):
            llm.generate(["ab", "cd", "ef"], [good, bad, good], use_tqdm=False)
    assert llm.engine.num_generated == generated and not llm.engine.has_unfinished()
    text = llm.generate(["ab"], good, use_tqdm=False)[0].outputs[0].text
    stopped = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    stopped.stop = text[2]
    out = llm.generate(["ab"], stopped, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == text[2] and out.text == text[:text.index(text[2])]


def test_nonfinite_logits_fail_one_request_only(llm, monkeypatch):
    runner = llm.engine.runner
    real = runner.logits

    def poisoned(hidden):
        out = real(hidden)
        if out.shape[0] == 2:  # only while both requests share the batch: request 0's row
            out[0, 3] = float("nan")
        return out

    monkeypatch.setattr(runner, "logits", poisoned)
    outs = llm.generate(["aa", "bb"], SamplingParams(temperature=0.8, seed=1, max_tokens=3), use_tqdm=False)
    assert outs[0].error and "non-finite" in outs[0].error and outs[0].outputs[0].finish_reason == "error"
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3


def test_an_id_already_in_flight_is_refused(llm):
    """A request whose id (or one of its n copies' ids) is in flight already is refused: the two would share
    aborts and outputs."""
    engine = llm.engine
    engine.add_request("r", None, [5, 6, 7], SamplingParams(max_tokens=2))
    engine.add_request("q-0", None, [5, 6, 7], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RequestError, match=r"^request r: id 'r' is already in flight; each request needs its own"):
            engine.add_request("r", None, [5], SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match=r"^request q: id 'q-0' is already in flight"):
            engine.add_request("q", None, [5], SamplingParams(max_tokens=2, n=2, temperature=1.0))
    finally:
        engine.abort("r")
        engine.abort("q-0")
    assert not engine.has_unfinished()


def test_constraints_that_leave_no_token_are_named_not_blamed_on_the_model(llm):
    """allowed_token_ids that bad_words then bans: that request fails at its first token naming its masks
    (it used to say the target produced non-finite logits); the request beside it runs on. Allowed ids
    that min_tokens bans (all EOS or stop ids) are refused before any work."""
    tok = llm.tokenizer.encode("x")[0]
    stuck = SamplingParams(temperature=0, max_tokens=3, allowed_token_ids=[tok], bad_words=["x"])
    outs = llm.generate(["aa", "bb"], [stuck, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)],
                        use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "non-finite logits (NaN" not in outs[0].error
    assert outs[0].error.startswith("no token could be sampled at output token 1: this request's "
                                    "allowed_token_ids, bad_words leave no token allowed there")
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3
    # a request that failed before any token has no first-token time (the latency histograms leave it out)
    assert outs[0].metrics["first_token_time"] is None and outs[1].metrics["first_token_time"] is not None
    # asking for logprobs too: the row's missing token (-1) was decoded as a logprob entry's text, which
    # failed the whole step (every request in it recomputed) and reported an engine failure
    logged = [SamplingParams(**{**kw, "logprobs": 1}) for kw in (
        dict(temperature=0, max_tokens=3, allowed_token_ids=[tok], bad_words=["x"]),
        dict(temperature=0, max_tokens=3, ignore_eos=True))]
    outs = llm.generate(["aa", "bb"], logged, use_tqdm=False)
    assert outs[0].error.startswith("no token could be sampled at output token 1"), outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].logprobs) == 3
    eos = llm.engine.output.eos_ids[0]
    with pytest.raises(RequestError, match=rf"allowed_token_ids \[{eos}\] are all EOS or stop_token_ids, which "
                                           r"min_tokens=2 bans: no token can be sampled"):
        llm.generate("aa", SamplingParams(max_tokens=4, allowed_token_ids=[eos], min_tokens=2), use_tqdm=False)
    both = SamplingParams(max_tokens=4, allowed_token_ids=[eos, 9], stop_token_ids=[9], min_tokens=2)
    with pytest.raises(RequestError, match="are all EOS or stop_token_ids"):
        llm.generate("aa", both, use_tqdm=False)
    # min_tokens bans EOS whatever ignore_eos says (vLLM's: EOS ids are always among the ids it bans), so an
    # ignore_eos request's first min_tokens tokens are no EOS either
    with pytest.raises(RequestError, match="are all EOS or stop_token_ids"):
        llm.generate("aa", SamplingParams(max_tokens=2, allowed_token_ids=[eos], min_tokens=2, ignore_eos=True),
                     use_tqdm=False)
    forced = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, ignore_eos=True, logit_bias={eos: 60.0})
    ids = llm.generate("aa", forced, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in ids[:2] and ids[2:] == [eos, eos]


def test_streamed_text_is_held_back_for_a_stop_string_only_when_the_stop_string_is_cut(llm):
    """A stream holds back the text that could begin a stop string while the string would be cut from the output;
    kept (include_stop_str_in_output) it is sent as it comes, as vLLM does: it was held back to the end."""
    from blockspec.engine.loop import _Tracker

    text = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = next(text[i:i + 4] for i in range(20, len(text) - 4) if text.count(text[i:i + 4]) == 1)
    for keep in (False, True):
        params = SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=keep)
        req = llm.engine.add_request(f"keep {keep}", "a", llm.tokenizer.encode("a"), params)[0]
        tracker, sent, lagged = _Tracker(req, "r", 0, 0.0), "", False
        while req.finish_reason is None:
            llm.engine.step()
            if (delta := tracker.poll()) is not None:
                sent += delta[1]
            lagged = lagged or (req.finish_reason is None and sent != req.text)
        assert sent == req.text == text[: text.index(stop) + (len(stop) if keep else 0)]
        assert lagged != keep


def test_the_extreme_seeds_and_biases_that_are_allowed_work(llm):
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=4, ignore_eos=True, logit_bias={7: -100.0})
              for seed in (2**63 - 1, -(2**63))]
    outs = llm.generate(["aa", "bb"], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 and 7 not in o.outputs[0].token_ids and not o.error for o in outs)


def test_a_request_whose_steps_fail_fails_alone_and_the_llm_serves_on(tmp_path):
    """Forwards raise whenever FAIL_PROMPT's request is in their batch: it fails with an error that names no
    internals, the requests beside it give their tokens alone, and the LLM serves the next call."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    llm = llm_with_faults(model=str(path), device="cpu", max_model_len=64, max_num_seqs=4)
    ref = LLM(str(path), device="cpu", max_model_len=64, max_num_seqs=4)
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, max_tokens=9, ignore_eos=True)]
    prompts = ["hello", FAIL_PROMPT, "world"]
    outs = llm.generate(prompts, [params[0], params[1], params[1]], use_tqdm=False)
    assert outs[1].error and "error id" in outs[1].error and "simulated" not in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error"
    want = ref.generate(["hello", "world"], [params[0], params[1]], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [o.outputs[0].token_ids for o in want]
    assert not llm.engine.has_unfinished() and not llm.engine.waiting
    again = llm.generate(["hello"], params[0], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == want[0].outputs[0].token_ids


def test_a_request_beside_many_failing_ones_is_not_failed_for_them(tmp_path):
    """Three requests, one after another, make the steps they share with a long request fail: each is found
    failing alone and failed; the long request, cleared each time, gives its tokens as alone (the failed
    steps counted against it too, and it was failed at the third)."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    llm = llm_with_faults(model=str(path), device="cpu", max_model_len=96, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    bystander = engine.add_request("bystander", "hello", tokenizer.encode("hello"), params)[0]
    culprits = []
    for i in range(3):
        engine.step()
        engine.step()
        culprits.append(engine.add_request(f"bad{i}", FAIL_PROMPT, tokenizer.encode(FAIL_PROMPT), params)[0])
        while culprits[-1].finish_reason is None:
            engine.step()
    while engine.has_unfinished():
        engine.step()
    want = LLM(str(path), device="cpu", max_model_len=96).generate(["hello"], params, use_tqdm=False)[0]
    assert [c.finish_reason for c in culprits] == ["error"] * 3
    assert bystander.finish_reason == "length" and bystander.output_ids == want.outputs[0].token_ids


def test_a_server_loop_whose_ranks_parted_stops_instead_of_serving_on(tmp_path):
    """A step that failed on some tensor-parallel ranks only (`RanksParted`) ends the server's engine loop: its
    ranks can no longer step together, so failing the requests in flight and serving on would hang them."""
    from blockspec.engine.loop import Add, EngineLoop
    from blockspec.errors import RanksParted
    from blockspec.inputs import Prompt

    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    llm = llm_with_faults(model=str(path), device="cpu", max_model_len=64)
    engine, tokenizer = llm.engine, llm.get_tokenizer()

    def parted(exc: Exception) -> None:
        raise RanksParted(f"this rank's step failed alone ({exc})")

    engine.check_failed_alike = parted
    add = Add("r", [Prompt(FAIL_PROMPT, tokenizer.encode(FAIL_PROMPT))], SamplingParams(max_tokens=4), 0.0)
    commands = iter([[add]])
    with pytest.raises(RanksParted, match="failed alone"):
        EngineLoop(engine, lambda report: None).run(lambda block: next(commands))  # no more: StopIteration


def test_an_interrupted_generate_leaves_nothing_queued(llm, monkeypatch):
    step = llm.engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["aa", "bb"], SamplingParams(max_tokens=20), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert llm.generate("aa", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_an_interrupt_while_prompts_are_queued_leaves_none_of_them(llm, monkeypatch):
    """Ctrl-C while a call queues its prompts (3,000 of them take a while): the ones already queued go too
    (they stayed, and the next call ran them all first)."""
    add = llm.engine.add_request
    added = []

    def interrupted(*args, **kwargs):
        if len(added) == 2:
            raise KeyboardInterrupt
        added.append(1)
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["aa", "bb", "cc", "dd"], SamplingParams(max_tokens=5), use_tqdm=False)
    monkeypatch.undo()
    assert len(added) == 2 and not llm.engine.has_unfinished()


def test_generate_from_two_threads_runs_one_call_at_a_time(llm):
    """Two threads calling one LLM: each gets its own prompts' tokens, as called one after the other (both
    stepped one engine at once, committing tokens twice, silently)."""
    import threading

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [["hello", "abc"], ["world", "xyz", "q"]]
    want = [[o.outputs[0].token_ids for o in llm.generate(p, params, use_tqdm=False)] for p in prompts]
    got: dict[int, list] = {}
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        got[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i], params, use_tqdm=False)]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == {0: want[0], 1: want[1]}


def test_llm_config_errors(tmp_path):
    path = save_tiny(tmp_path / "m", "llama")
    with pytest.raises(ConfigError, match="max_model_len=100000 exceeds"):
        LLM(str(path), device="cpu", max_model_len=100000)
    whole = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    for given in (-1, "auto"):  # vLLM's: the model's whole length (blockspec's default stops at 4096)
        assert LLM(str(path), device="cpu", max_model_len=given).engine.config.max_model_len == whole
    with pytest.raises(ConfigError, match="max_model_len must be an integer >= 2"):
        LLM(str(path), device="cpu", max_model_len=-2)
    with pytest.raises(ConfigError, match="speculative_config.method"):
        LLM(str(path), device="cpu", speculative_config={"method": "medusa", "model": "x"})
    with pytest.raises(ConfigError, match="unknown field"):
        LLM(str(path), device="cpu", speculative_config={"method": "dflash", "model": "x", "bogus": 1})
    for bad in ([], [0, 4], [2.5], "4"):
        with pytest.raises(ConfigError, match=r"draft_length_candidates must be a non-empty list of draft lengths"):
            LLM(str(path), device="cpu", speculative_config={"method": "dflash", "model": "x",
                                                              "draft_length_candidates": bad})
    # candidates past a given K, or with no policy to choose among them, are refused before the models load
    for extra, says in (({"num_speculative_tokens": 4, "draft_length_candidates": [6]}, r"\[6\]: each must be in 1..4"),
                        ({"draft_length_candidates": [2], "adaptive_draft_length": False}, "with adaptive_draft_length "
                                                                                            "false every step")):
        with pytest.raises(ConfigError, match=says):
            LLM(str(path), device="cpu", speculative_config={"method": "dflash", "model": "missing", **extra})
    with pytest.raises(ConfigError, match="async_scheduling must be true, false or None"):
        LLM(str(path), device="cpu", async_scheduling="yes")
    # a wrong type names its field (it used to raise float()'s or '<''s own error, or pass: "false" as true),
    # and a SpeculativeConfig built by hand is checked as its dict is (num_speculative_tokens=0 used to
    # load and silently become the drafter's block)
    for field, bad, says in [("confidence_threshold", "x", r"a number in \[0, 1\)"),
                             ("confidence_threshold", 5.0, r"a number in \[0, 1\)"),
                             ("max_batch_for_speculation", "4", ">= 1 or None"),
                             ("num_speculative_tokens", True, ">= 1 or None"),
                             ("adaptive_draft_length", "false", "true or false"),
                             ("adaptive_verification", 1, "true or false"),
                             ("model", None, "a drafter directory or hub id")]:
        spec = {"method": "dspark", "model": "x", field: bad}
        for given in (spec, SpeculativeConfig(**spec)):
            with pytest.raises(ConfigError, match=rf"^speculative_config\.{field} must be .*{says}.*got {bad!r}"):
                LLM(str(path), device="cpu", speculative_config=given)
    for field, bad, says in [("gpu_memory_utilization", "0.5", r"a number in \(0, 1\]"),
                             ("swap_space", -1, "a number of GiB >= 0 or None"), ("enforce_eager", "no", "true or false")]:
        with pytest.raises(ConfigError, match=rf"^{field} must be {says}, got {bad!r}"):
            LLM(str(path), device="cpu", **{field: bad})
    # every integer limit is checked before any work, its name and range in the message (a prefill limit of
    # 0 used to start and then fail every request; a bad seed to fail deep in torch)
    for field, bad, says in [("max_prefill_tokens", 0, ">= 1"), ("max_prefill_tokens", 1.5, ">= 1"),
                             ("max_num_seqs", True, ">= 1"), ("max_model_len", 1, ">= 2 or None"),
                             ("graph_prefill_tokens", -1, ">= 0"), ("kv_page_size", 0, r"in \[1, 1024\]"),
                             ("num_kv_pages", 0, ">= 1 or None"), ("seed", "x", r"in \[-9223372036854775808, "),
                             ("seed", 2**70, r"in \[.*, 9223372036854775807\] or None")]:
        with pytest.raises(ConfigError, match=rf"^{field} must be an integer {says}.*got {bad!r}"):
            LLM(str(path), device="cpu", **{field: bad})
    assert LLM(str(path), device="cpu", seed=-(2**63), max_prefill_tokens=1).engine.config.max_prefill_tokens == 1
    assert LLM(str(path), device="cpu", async_scheduling=True).engine.async_scheduling is True
    assert LLM(str(path), device="cpu").engine.async_scheduling is False  # auto: off on the CPU


def test_nonfinite_logits_fail_one_request_on_the_greedy_ids_path(llm, monkeypatch):
    model = llm.engine.runner.model
    real = model.head_logits  # compute_logits goes through it too

    def poisoned(hidden):
        out = real(hidden)
        if out.shape[0] == 2:
            out[0, 5] = float("nan")
        return out

    monkeypatch.setattr(model, "head_logits", poisoned)
    outs = llm.generate(["aa", "bb"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert outs[0].error and "non-finite" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 3


def test_prefill_runs_beside_decode(llm):
    """A long prompt prefilled in chunks does not stall requests that are already decoding."""
    engine = llm.engine
    old_budget = engine.config.max_prefill_tokens
    engine.config.max_prefill_tokens = 16
    try:
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        (a,) = engine.add_request("a", None, [5, 6, 7], params)
        engine.step()  # a: prefill and first token
        (b,) = engine.add_request("b", None, list(range(2, 90)), params)  # 88 tokens: 6 chunks of 16
        for _ in range(4):
            before = len(a.output_ids)
            engine.step()
            assert b.num_cached < len(b.prompt_token_ids) and len(a.output_ids) == before + 1
        while engine.has_unfinished():
            engine.step()
        alone = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert a.output_ids == alone
    finally:
        engine.config.max_prefill_tokens = old_budget


def test_padded_query_rows_leave_real_rows_unchanged(llm):
    """Graphed verify forwards pad each request's rows up to a bucket width: the padding must not change
    the real rows, must write only the trash column, and must sit at positions the RoPE table covers
    even for a request at the very end of its cache."""
    from blockspec.models.kv_cache import meta_from_tensors

    runner, pages = llm.engine.runner, llm.engine.pages
    cache = runner.cache
    end = cache.max_len - 3  # real rows end exactly at max_len; padding to width 8 would run past it
    slots = [pages.allocate(), pages.allocate()]
    for slot in slots:
        assert pages.reserve(slot, cache.max_len)
    pages.sync()
    starts, q_lens = [4, end], [5, 3]
    ids = torch.randint(5, 50, (2, 8))
    ids[0, 5:] = 0
    ids[1, 3:] = 0
    meta = meta_from_tensors(torch.tensor(slots), torch.tensor(starts), torch.tensor(q_lens), 8, cache.max_len,
                             cache.trash)
    assert meta.positions[1, 3:].tolist() == [end] * 5 and int(meta.positions.max()) < cache.max_len
    assert meta.write_pos[1, 3:].tolist() == [cache.trash] * 5
    wide, _ = runner.forward_ids(ids, q_lens, starts, slots)
    last_key = lambda: cache.gather(0, torch.tensor(slots[1:]), end)[0][0, :, end - 1]  # noqa: E731
    k0 = last_key().clone()
    narrow, _ = runner.forward_ids(ids[:, :5], q_lens, starts, slots)
    torch.testing.assert_close(wide[0, :5], narrow[0, :5])
    torch.testing.assert_close(wide[1, :3], narrow[1, :3])
    torch.testing.assert_close(last_key(), k0)
    for slot in slots:
        pages.release(slot)


def test_the_plain_step_head_graph_logic_gives_the_eager_tokens(tmp_path, monkeypatch):
    """The head graphs' inputs, padding and variants, with a stand-in for the CUDA graph (its replay re-runs
    the captured function into the same output buffer): greedy ids and sampled tokens equal the eager head
    and sampler's for batches padded to their bucket, greedy and sampled rows mixed, min-p, top-k / top-p (a
    graph of their own), a bad row; all-greedy columns take the greedy graph. tests/test_gpu.py runs the
    real graphs."""
    from blockspec.models import runner as runner_module
    from blockspec.sample import Columns

    def stand_in(fn, pool, outputs_outside=False):
        buffers = tuple(t.clone() for t in fn())

        class Replayed:
            def replay(self) -> None:
                for buf, t in zip(buffers, fn()):
                    buf.copy_(t)
        return Replayed(), buffers

    monkeypatch.setattr(runner_module, "capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    runner = LLM(str(save_tiny(tmp_path / "m", "qwen3", seed=2)), device="cpu", dtype="float32", warmup=False
                 ).engine.runner
    gen = torch.Generator().manual_seed(0)

    def both(hidden, columns):
        runner.use_graphs = True
        graphed = runner.next_ids(hidden, columns).clone()
        runner.use_graphs = False
        return graphed.tolist(), runner.next_ids(hidden, columns).tolist()

    h = runner.model.config.hidden_size
    for rows in (1, 3, 5):
        hidden = torch.randn(rows, h, generator=gen) * 4
        if rows > 1:
            hidden[-1, 0] = float("nan")
        for columns in (None, Columns.from_values([0.7] * rows, [11] * rows, list(range(rows))),
                        Columns.from_values([0.0] * rows, [1] * rows, [2] * rows),
                        Columns.from_values([0.0, 0.7, 1.3, 0.0, 2.0][:rows], [1, 2, 3, 4, 5][:rows], [9] * rows,
                                            min_p=[0.0, 0.1, 0.0, 0.2, 0.0][:rows]),
                        Columns.from_values([1.0] * rows, [7] * rows, [3] * rows, top_k=[0, 5, 3, 0, 2][:rows],
                                            top_p=[0.9, 1.0, 0.5, 0.7, 1.0][:rows])):
            graphed, eager = both(hidden, columns)
            assert graphed == eager and (graphed[-1] == -1) == (rows > 1), (rows, columns)
    heads = runner.head_graphs
    variants = (None, runner_module.SAMPLED_HEAD, runner_module.FILTERED_HEAD)
    assert {(b, f) for b in (1, 4, 8) for f in variants} == set(heads)
    # the rows' own values reach each replay: another seed draws other tokens, the eager ones for that seed
    hidden = torch.randn(4, h, generator=gen)
    drawn = [both(hidden, Columns.from_values([1.0] * 4, [seed] * 4, [5] * 4)) for seed in (1, 2)]
    assert drawn[0][0] == drawn[0][1] and drawn[1][0] == drawn[1][1] and drawn[0][0] != drawn[1][0]
    # a negative control: a replay that kept its first columns would give the first seed's tokens again
    cap = heads[(4, runner_module.SAMPLED_HEAD)]
    cap.floats, cap.ints = cap.floats.clone(), cap.ints.clone()  # writes now miss what the graph reads
    runner.use_graphs = True
    assert runner.next_ids(hidden, Columns.from_values([1.0] * 4, [1] * 4, [5] * 4)).tolist() == drawn[1][0]


def test_graph_key_extents():
    """SDPA graphs are bucketed by key length up to the cache; the kernel's one extent serves all."""
    from blockspec.models.runner import kv_extent, kv_extents

    assert kv_extents(1000, whole=False) == [256, 512, 1000]
    assert kv_extents(200, whole=False) == [200]
    assert kv_extents(1000, whole=True) == [1000]
    assert [kv_extent(n, 1000, False) for n in (1, 256, 257, 999)] == [256, 256, 512, 1000]
    assert kv_extent(5, 1000, True) == 1000


def test_prefill_batches_within_the_token_cap_take_a_graph(tmp_path):
    """A prefill batch replays a captured graph when its padded size (batch bucket x width, widths
    powers of two from 16) is within graph_prefill_tokens, with the Triton kernel only; decode and
    verify widths keep their own graphs; capture_all makes exactly the keys requests can ask for, and the
    plain step's head graphs."""
    from blockspec.models.runner import SAMPLED_HEAD, ModelRunner, prefill_graph_widths

    assert prefill_graph_widths(256) == [16, 32, 64, 128, 256] and prefill_graph_widths(15) == []
    model = LLM(str(save_tiny(tmp_path / "m", "qwen3", seed=2)), device="cpu", dtype="float32", warmup=False).model
    model.attention_backend = "triton"
    runner = ModelRunner(model, 8, 1000, use_cuda_graphs=True, query_buckets=(2, 5), graph_prefill_tokens=256)
    kv = runner.kv_extent(0)
    keys = {(rows, width): runner.graph_key(rows, width, 100, False) for rows, width in
            ((1, 1), (3, 5), (1, 6), (1, 40), (3, 64), (4, 64), (5, 64), (8, 32), (1, 256), (1, 257), (2, 200))}
    assert keys == {(1, 1): (1, 1, kv, False), (3, 5): (4, 5, kv, False), (1, 6): (1, 16, kv, False),
                    (1, 40): (1, 64, kv, False), (3, 64): (4, 64, kv, False), (4, 64): (4, 64, kv, False),
                    (5, 64): None, (8, 32): (8, 32, kv, False), (1, 256): (1, 256, kv, False), (1, 257): None,
                    (2, 200): None}
    captured, heads = [], []
    runner._capture = captured.append
    runner._capture_head = lambda b, feats: heads.append((b, feats))
    runner.capture_all([1, 2, 4, 8], tapped=False, untapped=True)
    # the plain step's heads, greedy (None) and sampled, at every bucket (a tiny vocabulary: all within the cap)
    assert set(heads) == {(b, feats) for b in (1, 2, 4, 8) for feats in (None, SAMPLED_HEAD)} and len(heads) == 8
    prefill = sorted((b, w) for b, w, _, _ in captured if w >= 16)
    assert prefill == [(b, w) for b in (1, 2, 4, 8) for w in (16, 32, 64, 128, 256) if b * w <= 256]
    assert sum(w < 16 for _, w, _, _ in captured) == 4 * 3  # widths 1, 2, 5 at each batch bucket
    assert not runner.sinks_context((1, 64, kv, True))  # no drafter: the taps come back
    runner.context_sink = lambda *args: None
    assert runner.sinks_context((1, 64, kv, True))  # a tapped prefill graph appends them itself
    assert not runner.sinks_context((1, 64, kv, False)) and not runner.sinks_context((1, 5, kv, True))
    runner.graph_prefill_tokens = 0
    assert runner.graph_key(1, 40, 100, False) is None and runner.graph_key(1, 5, 100, False) is not None
    runner.graph_prefill_tokens = 256
    model.attention_backend = "sdpa"  # SDPA graphs are bucketed by key length too: prefill stays eager
    assert runner.graph_key(1, 40, 100, False) is None and runner.graph_key(2, 5, 100, False) is not None


def detokenizer_cases(tokenizer, n: int, seed: int = 0):
    """Random prompts and outputs over the whole vocabulary (byte pieces, special tokens)."""
    import random

    rng = random.Random(seed)
    vocab, special = len(tokenizer), tokenizer.all_special_ids
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        yield prompt, [rng.choice(special) if rng.random() < 0.05 else rng.randrange(vocab)
                       for _ in range(rng.randrange(1, 40))]


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_equals_the_offsets_chunk_for_chunk(skip):
    """The tokenizers library's DecodeStream gives, token by token, the text the two-decode offsets
    give, on the embedded tokenizer; prompt tails that end mid-character keep the offsets."""
    from pathlib import Path

    from blockspec.request import IncrementalDetokenizer
    from blockspec.engine.build import load_tokenizer

    tok = load_tokenizer(Path(__file__).parent.parent / "blockspec" / "assets" / "default" / "target")
    streamed = 0
    for prompt, out in detokenizer_cases(tok, 300):
        fast, ref = IncrementalDetokenizer(tok, prompt, skip), IncrementalDetokenizer(tok, prompt, skip, fast=False)
        assert ref.stream is None
        on_stream = fast.stream is not None
        streamed += on_stream
        assert [fast.add(t) for t in out] == [ref.add(t) for t in out]
        assert fast.text == ref.text and (fast.stream is not None) == on_stream  # no step was refused
    assert 250 < streamed < 300  # both kinds of prompt tail were drawn


@pytest.mark.parametrize("fast", [True, False])
def test_first_output_space_after_a_tail_of_skipped_special_tokens(fast):
    """A decoder that strips one leading space (Llama-2, Mistral) strips it from the whole text: after a prompt
    ending in more skipped special tokens than the detokeniser's usual window, the first output token keeps its
    space as a decode of the whole prompt gives it (vLLM primes with the whole prompt)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from blockspec.request import IncrementalDetokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581hello": 3, "\u2581world": 4, "\u2581there": 5}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    for tail in (1, 6, 13):
        prompt = [1, 3, 4] + [2] * tail
        whole = tok.decode(prompt + [3, 5], skip_special_tokens=True)
        detok = IncrementalDetokenizer(tok, prompt, True, fast=fast)
        assert "".join(detok.add(t) for t in [3, 5]) == whole[len(tok.decode(prompt, skip_special_tokens=True)):] \
            == " hello there"


def test_a_refused_stream_step_hands_over_to_the_offsets():
    """When the stream refuses a step (its check that the emitted text is still a prefix), the
    offsets decode that token and the rest from the same state: no text lost or repeated."""
    from pathlib import Path

    from blockspec.request import IncrementalDetokenizer
    from blockspec.engine.build import load_tokenizer

    tok = load_tokenizer(Path(__file__).parent.parent / "blockspec" / "assets" / "default" / "target")
    ids = tok.encode("déjà vu: naïve café, 東京 and ünïcödé all the way down " * 3)
    cut = next(k for k in range(5, len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd"))
    prompt, out = ids[:cut], ids[cut:]
    fast = IncrementalDetokenizer(tok, prompt, True)
    stream, calls = fast.stream, []
    assert stream is not None

    class Refusing:
        def step(self, backend, token):
            calls.append(token)
            if len(calls) == 9:
                raise Exception("Invalid prefix encountered")
            return stream.step(backend, token)

    fast.stream = Refusing()
    ref = IncrementalDetokenizer(tok, prompt, True, fast=False)
    assert [fast.add(t) for t in out] == [ref.add(t) for t in out]
    assert len(calls) == 9 and fast.stream is None and fast.text == tok.decode(out)


def test_text_kept_in_parts_reads_as_the_joined_text():
    """The detokeniser keeps its text as the pieces it returned: every suffix read (`text_from`) and the whole
    text equal the pieces joined, before and after a whole read joins them, and the length counts them."""
    import random
    from pathlib import Path

    from blockspec.request import IncrementalDetokenizer
    from blockspec.engine.build import load_tokenizer

    tok = load_tokenizer(Path(__file__).parent.parent / "blockspec" / "assets" / "default" / "target")
    ids = tok.encode("def parse(s):\n    return {k: v for k, v in s.items()}  # déjà vu, 東京\n" * 12)
    detok, pieces, rng = IncrementalDetokenizer(tok, ids[:4], True), [], random.Random(0)
    for i, t in enumerate(ids[4:]):
        pieces.append(detok.add(t))
        joined = "".join(pieces)
        assert detok.length == len(joined)
        for start in {0, len(joined), len(joined) + 3, rng.randrange(len(joined) + 1)}:
            assert detok.text_from(start) == joined[start:]
        if i % 37 == 0:  # a whole read joins the parts; the reads after it still agree
            assert detok.text == joined
    assert detok.text == tok.decode(ids[4:]) and len(detok._parts) == 1


def test_cache_plan_is_what_the_caches_allocate(tmp_path):
    """The start-up plan prices a page as the pools allocate it (target and drafter, the trash page
    included), and on the CPU allocates what max_num_seqs x max_model_len can use."""
    from pathlib import Path

    from blockspec.models.kv_cache import PageTable
    from blockspec.drafters import load_drafter
    from factories import save_drafter_target

    llm = LLM(str(save_drafter_target(tmp_path / "t")), device="cpu", dtype="float32", max_model_len=100,
              max_num_seqs=3, kv_page_size=8)
    model, pages = llm.model, llm.engine.pages
    assert pages.page_size == 8 and pages.num_pages == 3 * (pages.max_len // 8 + 1)
    assert llm.engine.runner.cache.bytes == model.page_bytes(8) * (pages.num_pages + 1)
    table = PageTable(3, 117, 16, 10, "cpu")
    assert model.new_cache(table, 117, "cpu").bytes == model.page_bytes(16) * 11
    drafter = load_drafter("dflash", str(Path(__file__).parent / "fixtures" / "drafters" / "dflash"), "cpu",
                           torch.float32)
    assert drafter.new_cache(table, 50, "cpu").bytes == drafter.page_bytes(16) * 11
    assert drafter.page_bytes(16, torch.bfloat16) * 2 == drafter.page_bytes(16)


def test_a_page_plan_that_cannot_hold_one_sequence_is_refused_with_its_numbers():
    from blockspec.config import EngineConfig
    from blockspec.engine.memory import check_plan

    gib = 1 << 30
    cfg = EngineConfig(max_model_len=8192, kv_page_size=16, gpu_memory_utilization=0.9)
    assert check_plan(513, 513, gib, cfg) == 513  # exactly one sequence
    with pytest.raises(ConfigError) as e:
        check_plan(512, 513, gib, cfg)
    assert "num_kv_pages=512 (8192 positions of kv_page_size=16)" in str(e.value) and "needs 513 pages" in str(e.value)
    # 80 GiB card, 16 GiB of weights in use, 2 GiB reserved: 0.9 x 80 - 16 - 2 = 54 GiB for pages
    with pytest.raises(ConfigError) as e:
        check_plan(53, 513, gib, cfg, budget=(54 * gib, 80 * gib, 16 * gib, 2 * gib))
    msg = str(e.value)
    assert "max_model_len=8192 needs 513 KV pages (513.00 GiB)" in msg and "54.00 GiB are left" in msg
    assert "gpu_memory_utilization=0.9 x 80.0 GiB" in msg
    for bad in (dict(kv_page_size=0), dict(kv_page_size=1.5), dict(num_kv_pages=0)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_page_table_reserves_releases_and_syncs_what_changed():
    """Pages come from one pool; a released slot's entries point to the trash page again (a padded row
    writing its trash position must not land in a page another request now holds); the device table
    changes only at `sync`."""
    from blockspec.models.kv_cache import PageTable

    t = PageTable(max_slots=3, max_len=40, page_size=8, num_pages=7, device="cpu")
    assert t.columns == 6 and t.trash_page == 7 and (t.table == 7).all()
    a, b = t.allocate(), t.allocate()
    assert t.reserve(a, 17) and t.held(a) == 3 and t.num_free_pages == 4
    assert (t.table == 7).all()  # nothing on the device before sync
    t.sync()
    assert t.table[a, :3].tolist() == [0, 1, 2] and (t.table[a, 3:] == 7).all()
    assert t.reserve(a, 24) and t.held(a) == 3  # already held: nothing taken
    assert not t.reserve(b, 40) and t.held(b) == 0 and t.num_free_pages == 4  # too few: nothing taken
    assert t.missing(b, 10**6) == t.columns  # capped at the table's extent
    assert t.reserve(b, 32)
    t.sync()
    assert t.table[b, :4].tolist() == [3, 4, 5, 6] and t.num_free_pages == 0
    t.release(a)
    t.sync()
    assert (t.table[a] == 7).all() and t.num_free_pages == 3 and t.num_free_slots == 2
    assert t.allocate() == a and t.reserve(a, 8)
    t.sync()
    assert t.table[a, 0].item() in (0, 1, 2)
    with pytest.raises(ValueError, match="released twice"):
        t.release(2)


def test_gpu_memory_utilization_out_of_range_is_refused():
    from blockspec.config import EngineConfig

    for bad in (0, 1.5, -0.1):
        with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
            EngineConfig(gpu_memory_utilization=bad)


@pytest.fixture
def pipelined(llm):
    """The module's engine with asynchronous plain steps (on by default only on CUDA), counting the
    plain steps that were launched ahead of their predecessor's commit."""
    engine = llm.engine
    launches: list[int] = []
    real = engine._plain_step_pipelined

    def counted(reqs):
        launches.append(len(reqs))
        return real(reqs)

    engine.async_scheduling, engine._plain_step_pipelined = True, counted
    yield llm, launches
    engine.async_scheduling = False
    del engine._plain_step_pipelined


def test_pipelined_plain_steps_emit_exactly_what_synchronous_ones_do(llm, pipelined):
    """Launching a plain step from the in-flight step's device ids, before committing them, changes
    nothing emitted: the same tokens, and no token past a stop (EOS, stop id, stop string,
    max_tokens) from the step that was already in flight when the request stopped."""
    base = llm.generate("a", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids, text = base.outputs[0].token_ids, base.outputs[0].text
    cases = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 17)]
    cases += [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[7]]),
              SamplingParams(temperature=0, max_tokens=40, stop=[text[12:15]]),
              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    prompts = ["a"] * len(cases)
    pipelined_llm, launches = pipelined
    got = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
           for o in pipelined_llm.generate(prompts, cases, use_tqdm=False)]
    assert launches and max(launches) == len(cases) - 1  # every request left after prefill (max_tokens=1 is done)
    llm.engine.async_scheduling = False
    want = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
            for o in llm.generate(prompts, cases, use_tqdm=False)]
    assert got == want
    assert [len(t) for t, _, _ in got[:4]] == [1, 2, 3, 17] and got[-1][0] == ids


def test_pipelined_sampled_steps_draw_what_synchronous_ones_do(llm, pipelined):
    """At T > 0 a plain step is launched before the one in flight is committed too: the noise is keyed
    by the position a row samples, so every token equals the synchronous run's (temperature, top-k,
    top-p, min-p, a logit bias, and a greedy row in the same batch). A batch with a penalty or
    min_tokens (which count committed tokens) or logprobs (kept per committed token) is not launched
    ahead, and still samples as the synchronous run does."""
    sampled = dict(max_tokens=24, ignore_eos=True)
    cases = [SamplingParams(temperature=0.9, seed=1, **sampled),
             SamplingParams(temperature=1.3, top_k=7, seed=2, **sampled),
             SamplingParams(temperature=0.8, top_p=0.85, min_p=0.02, seed=3, **sampled),
             SamplingParams(temperature=1.0, seed=4, logit_bias={5: 3.0, 9: -100.0}, **sampled),
             SamplingParams(temperature=0, **sampled)]
    waiting = [[SamplingParams(temperature=0.9, seed=5, **extra, **sampled)] * 2
               for extra in (dict(presence_penalty=1.5), dict(min_tokens=20), dict(logprobs=2))]
    prompts = ["ab", "cd", "ef", "gh", "ab"]
    pipelined_llm, launches = pipelined
    got = [o.outputs[0].token_ids for o in pipelined_llm.generate(prompts, cases, use_tqdm=False)]
    assert launches and max(launches) == len(cases)  # the sampled rows were launched ahead with the greedy one
    n_launches = len(launches)
    got_waiting = [[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
                    pipelined_llm.generate(["ab", "cd"], params, use_tqdm=False)] for params in waiting]
    assert len(launches) == n_launches
    llm.engine.async_scheduling = False
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, cases, use_tqdm=False)]
    assert got == want
    assert got_waiting == [[(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
                            llm.generate(["ab", "cd"], params, use_tqdm=False)] for params in waiting]
    assert got[0] != got[4]  # the sampled rows really sampled: same prompt, not the greedy tokens


def test_pipeline_survives_aborts_arrivals_and_nonfinite_rows(llm, pipelined, monkeypatch):
    """A request aborted while its next step is in flight gets nothing more; a request arriving
    mid-pipeline (a prefill step) and a request failing on non-finite logits leave the others' output
    as it would be alone."""
    pipelined_llm, launches = pipelined
    engine = pipelined_llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    alone = {p: llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in ("aa", "bb", "cc")}
    reqs = {p: engine.add_request(p, None, llm.tokenizer.encode(p), params)[0] for p in ("aa", "bb")}
    for _ in range(6):
        engine.step()
    assert engine.pipeline.inflight is not None
    engine.abort("bb")
    n_bb = len(reqs["bb"].output_ids)
    reqs["cc"] = engine.add_request("cc", None, llm.tokenizer.encode("cc"), params)[0]
    while engine.has_unfinished():
        engine.step()
    assert len(reqs["bb"].output_ids) == n_bb and reqs["bb"].finish_reason == "abort"
    assert reqs["aa"].output_ids == alone["aa"] and reqs["cc"].output_ids == alone["cc"]
    assert len(launches) > 10
    # a non-finite row fails its request alone (its -1 id must not be fed to the next launch)
    model = engine.runner.model
    real = model.head_logits  # compute_logits goes through it too

    def poisoned(hidden):
        out = real(hidden)
        if out.shape[0] == 2 and len(reqs["dd"].output_ids) == 4:
            out[0, 5] = float("nan")
        return out

    monkeypatch.setattr(model, "head_logits", poisoned)
    reqs["dd"] = engine.add_request("dd", None, llm.tokenizer.encode("aa"), params)[0]
    reqs["ee"] = engine.add_request("ee", None, llm.tokenizer.encode("cc"), params)[0]
    while engine.has_unfinished():
        engine.step()
    dd = reqs["dd"].output_ids  # the poisoned row is the 5th or (computed ahead) the 6th token
    assert reqs["dd"].error and "non-finite" in reqs["dd"].error and 4 <= len(dd) <= 5 and dd == alone["aa"][: len(dd)]
    assert reqs["ee"].output_ids == alone["cc"]


def test_host_lists_reach_the_device_under_a_default_device_context():
    """`to_device` builds its host tensor on the CPU even when a `torch.device(...)` context makes
    another device the default (under "cuda" a GPU tensor cannot be pinned; "meta" stands in for
    it here, as nothing can be copied out of a meta tensor)."""
    from blockspec.transfer import to_device

    with torch.device("meta"):
        got = to_device([3, 1, 2], torch.int64, "cpu")
    assert got.device.type == "cpu" and got.tolist() == [3, 1, 2]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["synchronous", "pipelined"])
def test_requests_preempted_for_pages_give_what_they_give_alone(tmp_path, asynchronous):
    """A pool of KV pages for about one max_model_len sequence and six requests that grow long: the
    newest are preempted and recomputed (more than once), and every output (greedy, seeded sampling,
    penalties, logprobs, stop strings) equals the one it gets from an engine with room for all; no
    request waits behind a full pool for ever, and the pool is whole at the end."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    roomy = LLM(str(path), device="cpu", max_model_len=160, max_num_seqs=4)
    tight = LLM(str(path), device="cpu", max_model_len=160, max_num_seqs=4, num_kv_pages=12, kv_page_size=16)
    tight.engine.async_scheduling = asynchronous
    prompts = ["def main():", "import os\n", "class A:", "x = 1", "for i in range(3):", "print("]
    params = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=110, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=100,
                             ignore_eos=True),
              SamplingParams(temperature=0, logprobs=2, max_tokens=90, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=6, min_tokens=20, max_tokens=100),
              SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)]
    want = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
    # recomputed K/V come from a prefill's products, not one row at a time: the same to rounding
    for g, w in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs):
        assert g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-5 for t in g)
    preempted = tight.get_stats()["num_preemptions"]
    assert preempted > 2 and roomy.get_stats()["num_preemptions"] == 0
    pages = tight.engine.pages
    assert pages.num_free_pages == pages.num_pages and pages.num_free_slots == 4


def test_admission_waits_for_pages_not_only_slots(tmp_path):
    """Free slots but too few free pages for a prompt's first chunk: the request waits in the queue
    (no preemption for an arrival) and joins when pages come back."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    llm = LLM(str(path), device="cpu", max_model_len=160, max_num_seqs=4, num_kv_pages=12, kv_page_size=16)
    engine = llm.engine
    long = list(range(5, 125))  # 120 tokens: 8 of the 12 pages with the lookahead
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = engine.add_request("a", None, long, params)[0]
    second = engine.add_request("b", None, long[::-1], params)[0]
    engine.step()
    assert engine.running == [first] and list(engine.waiting) == [second] and engine.pages.num_free_slots == 3
    while engine.has_unfinished():
        engine.step()
    assert engine.metrics()["num_preemptions"] == 0
    alone = llm.generate([{"prompt_token_ids": long[::-1]}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert second.output_ids == alone


def test_a_pool_too_small_for_one_sequence_is_refused(tmp_path):
    path = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=7)
    with pytest.raises(ConfigError, match=r"num_kv_pages=5 \(80 positions of kv_page_size=16\) cannot hold one "
                                          r"sequence of max_model_len=160"):
        LLM(str(path), device="cpu", max_model_len=160, num_kv_pages=5, kv_page_size=16)


def test_a_batch_mixing_penalties_and_none_gives_each_its_own_output(llm):
    """Requests with penalties beside requests without them in one step: each gets what it gets alone
    (the ones without have no history to stack beside the others')."""
    penalised = SamplingParams(temperature=0.8, seed=4, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=20,
                               ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = [llm.generate(p, q, use_tqdm=False)[0].outputs[0].token_ids
             for p, q in (("def main():", plain), ("import os", penalised))]
    together = llm.generate(["def main():", "import os"], [plain, penalised], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in together] == alone
    unpenalised = SamplingParams(temperature=0.8, seed=4, max_tokens=20, ignore_eos=True)  # the penalties act
    assert llm.generate("import os", unpenalised, use_tqdm=False)[0].outputs[0].token_ids != alone[1]


@pytest.mark.parametrize("store", ["float32", "fp8"])
def test_every_layers_write_and_gather_equal_each_layers(store):
    """`KVCache.write_layers` / `gather_layers` (a drafter's context, all its layers at once) against `write` /
    `gather` a layer at a time: pages interleaved between slots, lengths inside a page, an FP8 store with a scale a
    layer and a head; the room after each slot's positions is left for the caller."""
    from blockspec.models.kv_cache import FP8, KVCache, PageTable, causal_meta

    def pair():
        table = PageTable(3, 24, 4, 14, "cpu")
        for tokens in (4, 8, 12, 16):  # the slots' pages alternate in the pool
            for slot in (0, 1, 2):
                table.reserve(slot, tokens)
        table.sync()
        fp8 = dict(kv_dtype=FP8, k_scale=(0.5, (0.25, 2.0), 1.0), v_scale=4.0) if store == "fp8" else {}
        return KVCache(3, 2, 8, 24, torch.float32, "cpu", table, **fp8), KVCache(3, 2, 8, 24, torch.float32, "cpu",
                                                                                   table, **fp8)

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 3, 2, 6, 8, generator=g), torch.randn(3, 3, 2, 6, 8, generator=g)
    meta = causal_meta([2, 0, 1], [0, 5, 9], [6, 4, 2], 6, 24, "cpu")  # rows past a request's count: the trash
    by_layer, at_once = pair()
    for layer in range(3):
        by_layer.write(layer, meta, k[layer], v[layer])
    at_once.write_layers(meta, k, v)
    assert torch.equal(by_layer.k_layers, at_once.k_layers) and torch.equal(by_layer.v_layers, at_once.v_layers)
    slots, kv_len = torch.tensor([0, 2, 1]), 11
    keys, values = at_once.gather_layers(slots, kv_len, room=5)
    assert keys.shape[:3] == (3, 3, 2) and keys.shape[3] >= kv_len + 5
    for layer in range(3):
        want_k, want_v = by_layer.gather(layer, slots, kv_len)
        assert torch.equal(keys[layer, :, :, :kv_len], want_k) and torch.equal(values[layer, :, :, :kv_len], want_v)
    assert not torch.equal(keys[1, :, :, :kv_len], keys[0, :, :, :kv_len])  # control: the layers differ


def test_abort_takes_a_request_and_its_copies_not_a_request_whose_id_starts_alike(llm):
    """Aborting "job" ends job and its n copies (job-0, job-1); another caller's "job-2" (or "job-x") runs on
    (its id starting with "job-" made it one of job's copies)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    job = engine.add_request("job", None, [5, 6, 7], params)
    copies = engine.add_request("pair", None, [5, 6, 7], SamplingParams(n=2, temperature=0.5, max_tokens=6))
    others = [engine.add_request(rid, None, [8, 9], params)[0] for rid in ("job-2", "job-x", "pair-5")]
    engine.step()
    engine.abort("job")
    engine.abort("pair")
    while engine.has_unfinished():
        engine.step()
    assert [r.finish_reason for r in job + copies] == ["abort"] * 3
    assert [(r.finish_reason, len(r.output_ids)) for r in others] == [("length", 6)] * 3
