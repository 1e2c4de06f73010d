"""Structured output: every token keeps the request's grammar, and speculation keeps it exactly.

The drafts here are the target's own unconstrained continuation, which the grammar mostly forbids
while the unconstrained target would accept them: only masks on every verify row (the grammar's state
after the drafts before it) make speculative output equal plain constrained decoding. A control with
the masks of the rows after the first taken away shows the equality test catches that."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import llguidance.torch
import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.errors import RequestError
from blockspec.sample.processors import apply_bitmask
from blockspec.sampling_params import SamplingError, StructuredOutputsParams
from blockspec.structured import Masks
from factories import save_drafter_target

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "yy", "zzz"]}},
          "required": ["a", "b"], "additionalProperties": False}
PROMPTS = ["hello", "x = 1", "def f():", "{", "The answer"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target"), tokenizer=True)


@pytest.fixture(scope="module")
def plain(target) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=160)


def speculative(target: Path, method: str = "dflash", fixture: str = "dflash", **spec) -> LLM:
    return LLM(str(target), device="cpu", max_model_len=160,
               speculative_config={"method": method, "model": str(FIXTURES / fixture), "adaptive_draft_length": False,
                                   **spec})


def with_unconstrained_drafts(llm: LLM, plain: LLM) -> None:
    """Drafts = what the target would say next without the grammar (its greedy continuation)."""
    proposer = llm.engine.proposer
    real = proposer.propose

    def propose(reqs, budgets, last_tokens=None, draft_params=None):
        block = real(reqs, budgets, last_tokens, draft_params)
        tokens = block.tokens.clone()
        for r, req in enumerate(reqs):
            if not block.lens[r]:
                continue
            ids = req.prompt_token_ids + req.output_ids
            free = plain.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=block.lens[r],
                                                                              ignore_eos=True), use_tqdm=False)
            drafts = free[0].outputs[0].token_ids
            tokens[r, : len(drafts)] = torch.tensor(drafts)
        block.tokens = tokens
        return block

    proposer.propose = propose


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def check_schema(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"a", "b"} and 0 <= value["a"] <= 99 and value["b"] in ("x", "yy", "zzz"), text


def test_blockspec_loads_without_llguidance_until_a_request_has_a_grammar(target):
    """llguidance's torch helpers pull in torch's compiler stack (seconds at every start): the engine, the CLI
    and the server import it only when a grammar is compiled, and a constrained request still gets it."""
    script = f"""
import sys
import blockspec.cli, blockspec.server.app
from blockspec import LLM, SamplingParams
from blockspec.sampling_params import StructuredOutputsParams
llm = LLM({str(target)!r}, device="cpu", seed=0)
llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0))
before = "llguidance" in sys.modules
out = llm.generate(["def f(x):"], SamplingParams(max_tokens=8, temperature=0.0,
                   structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))
print(before, "llguidance" in sys.modules, repr(out[0].outputs[0].text))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, text = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert (before, after) == ("False", "True") and text in ("'yes'", "'no'"), done.stdout


def test_the_bitmask_leaves_exactly_the_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (5, 4), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    llguidance.torch.apply_token_bitmask_inplace(want, bits)
    got = apply_bitmask(logits.clone(), bits)
    assert torch.equal(got, want) and (got == float("-inf")).any() and (got > float("-inf")).any()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_json_schema_output_is_valid_and_speculation_gives_plain_output(target, plain, temperature):
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    for text in texts(want):
        check_schema(text)
    assert all(o.outputs[0].finish_reason == "stop" for o in want)
    llm = speculative(target, num_speculative_tokens=3)
    with_unconstrained_drafts(llm, plain)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert ids(got) == ids(want)
    metrics = llm.get_stats()
    assert metrics["num_accepted_tokens"] > 0 and metrics["num_accepted_tokens"] < metrics["num_draft_tokens"]


def drafting_plains_tokens_then(llm: LLM, plain_outputs: list, eos: int):
    """The speculative LLM's drafts become plain decoding's own tokens of each prompt, then EOS; returns the
    proposer's own propose, to put back."""
    plain_ids = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in plain_outputs}
    proposer = llm.engine.proposer
    real = proposer.propose

    def propose(reqs, budgets, last_tokens=None, draft_params=None):
        block = real(reqs, budgets, last_tokens, draft_params)
        for r, req in enumerate(reqs):
            n = block.lens[r]
            drafts = plain_ids[tuple(req.prompt_token_ids)][len(req.output_ids):][:n]
            block.tokens[r, :n] = torch.tensor(drafts + [eos] * (n - len(drafts)))
        return block

    proposer.propose = propose
    return real


def test_a_block_that_completes_the_grammar_ends_where_plain_decoding_does(target, plain):
    """Drafts are plain decoding's own tokens, then EOS: the grammar's last token is an accepted draft and
    the row after it, masked to EOS, accepts the EOS draft. The request must end at the grammar's last
    token, as plain decoding does, not commit the EOS after it."""
    cases = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")]
    llm = speculative(target, num_speculative_tokens=3)
    eos = llm.engine.output.eos_ids[0]
    for spec in cases:
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec)
        want = plain.generate(PROMPTS, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" and eos not in o.outputs[0].token_ids for o in want)
        real = drafting_plains_tokens_then(llm, want, eos)
        before = llm.get_stats()
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.engine.proposer.propose = real
        assert ids(got) == ids(want) and [o.outputs[0].stop_reason for o in got] == [None] * len(PROMPTS)
        assert llm.get_stats()["num_accepted_tokens"] > before["num_accepted_tokens"]


@pytest.mark.parametrize("ban", ["min_tokens", "allowed_token_ids"])
def test_a_block_that_completes_the_grammar_under_a_ban_on_eos_ends_where_plain_decoding_does(target, plain, ban):
    """min_tokens past the grammar's length, or allowed_token_ids without EOS: the row after the draft that
    completes the grammar allows only EOS, which the ban removed, and its request failed ("no token could be
    sampled") where plain decoding ends at the grammar's last token. That row is never emitted from: it keeps
    the grammar's mask."""
    llm = speculative(target, num_speculative_tokens=3)
    eos = llm.engine.output.eos_ids[0]
    vocab = llm.engine.vocab_size
    extra = {"min_tokens": 50} if ban == "min_tokens" else {"allowed_token_ids": [t for t in range(vocab) if t != eos]}
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        regex=r"[a-c]{3}-[0-9]{2}"), **extra)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "stop" for o in want)
    drafting_plains_tokens_then(llm, want, eos)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.error for o in got] == [None] * len(PROMPTS)
    assert ids(got) == ids(want) and [o.outputs[0].finish_reason for o in got] == ["stop"] * len(PROMPTS)


def test_verify_rows_without_their_draft_masks_break_the_equality(target, plain, monkeypatch):
    """The control: each verify row but the first left unmasked, the unconstrained drafts pass."""
    add = Masks.add
    monkeypatch.setattr(Masks, "add", lambda self, matcher, row, drafts: add(self, matcher, row, []))
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    llm = speculative(target, num_speculative_tokens=3)
    with_unconstrained_drafts(llm, plain)
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert ids(got) != ids(want)


@pytest.mark.parametrize("method, fixture", [("dflash", "dflash"), ("dspark", "dspark_vanilla")])
def test_regex_choice_and_grammar_hold_with_every_drafter(target, plain, method, fixture):
    def an_object(text: str, finish: str) -> bool:  # a random model's free object may outrun max_tokens
        return isinstance(json.loads(text), dict) if finish == "stop" else text.startswith("{")

    cases = [(StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}"), lambda t, _: re.fullmatch(r"[a-c]{3}-[0-9]{2}", t)),
             (StructuredOutputsParams(choice=["red", "green", "blue"]), lambda t, _: t in ("red", "green", "blue")),
             (StructuredOutputsParams(grammar='start: "yes" | "no" | "maybe"'), lambda t, _: t in ("yes", "no", "maybe")),
             # GBNF, as llama.cpp and vLLM's docs write grammars
             (StructuredOutputsParams(grammar='root ::= "x = " [0-9]+'), lambda t, f: re.fullmatch(r"x = [0-9]+", t)
              or (f == "length" and re.fullmatch(r"x = [0-9]*", t))),
             (StructuredOutputsParams(json_object=True), an_object)]
    llm = speculative(target, method, fixture)
    for spec, valid in cases:
        params = SamplingParams(temperature=0.7, seed=11, max_tokens=40, structured_outputs=spec)
        want = plain.generate(PROMPTS, params, use_tqdm=False)
        assert all(valid(o.outputs[0].text, o.outputs[0].finish_reason) for o in want), (spec, texts(want))
        assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == ids(want)


def test_copies_and_preempted_requests_keep_their_grammar(target, plain):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    out = plain.generate(["hi"], params, use_tqdm=False)[0]
    for copy in out.outputs:
        check_schema(copy.text)
    small = LLM(str(target), device="cpu", max_model_len=160, num_kv_pages=11, kv_page_size=16)
    long = StructuredOutputsParams(regex="[a-z ]{90}")  # requests that outgrow the pool, so some are preempted
    single = SamplingParams(temperature=0.9, seed=2, max_tokens=100, structured_outputs=long)
    many = [f"prompt number {i} " * 3 for i in range(6)]
    got = small.generate(many, single, use_tqdm=False)
    assert small.get_stats()["num_preemptions"] > 0
    assert all(re.fullmatch("[a-z ]{90}", t) for t in texts(got))
    assert ids(got) == ids(plain.generate(many, single, use_tqdm=False))


def test_a_constraint_is_compiled_once_for_every_prompt_and_copy(plain):
    """Each prompt of a list, and each of n copies, takes a copy of one compiled grammar (each compiled its
    own, twice: at the check and at the engine; a large choice made a list of prompts take seconds); the
    copies advance apart, so each output keeps the grammar."""
    from blockspec.structured import _compiled

    choice = [f"option {i}" for i in range(300)] + ["the answer"]
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(choice=choice))
    before = _compiled.cache_info().misses
    outs = plain.generate(PROMPTS, params, use_tqdm=False)
    assert _compiled.cache_info().misses == before + 1
    assert all(c.text in choice for o in outs for c in o.outputs) and len({c.text for o in outs for c in o.outputs}) > 1


def test_bad_constraints_fail_before_any_work(plain, target):
    with pytest.raises(SamplingError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(RequestError, match="prompt 0: structured_outputs") as caught:
        plain.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), use_tqdm=False)
    # one line: llguidance's drawing of the source with carets under the fault is dropped
    assert "\n" not in str(caught.value) and "unclosed character class" in str(caught.value), str(caught.value)
    for spec in (StructuredOutputsParams(grammar="start: ("), StructuredOutputsParams(grammar="start: foo"),
                 StructuredOutputsParams(grammar='root ::= "a" undefined_rule')):
        with pytest.raises(RequestError, match="prompt 1: structured_outputs: ") as caught:
            plain.generate(["a", "b"], [SamplingParams(), SamplingParams(structured_outputs=spec)], use_tqdm=False)
        assert "\n" not in str(caught.value) and "^" not in str(caught.value), str(caught.value)
    with pytest.raises(RequestError, match="structured_outputs"):
        plain.generate(["a"], SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json")),
                       use_tqdm=False)
    assert not plain.engine.has_unfinished()
    bare = LLM(str(save_drafter_target(target.parent / "bare")), device="cpu", max_model_len=64)
    with pytest.raises(RequestError, match="structured outputs need the model's tokenizer"):
        bare.generate([{"prompt_token_ids": [5, 6]}],
                      SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")), use_tqdm=False)


def test_an_output_leaving_its_grammar_fails_with_one_line():
    """llguidance's error for a token the grammar refuses is a line followed by kilobytes of its parser's state;
    the request's error keeps the line."""
    from blockspec.engine.output import grammar_ending

    class Refusing:
        def consume_tokens(self, tokens):
            return False

        def get_error(self):
            return 'Parser Error: token "\\ufffd[16386]" doesn\'t satisfy the grammar\n' + "state " * 2000

    ending = grammar_ending(Refusing(), [16386])
    assert ending.reason == "error" and "\n" not in ending.error and len(ending.error) < 300
    assert ending.error.startswith("the output left its structured-output grammar: Parser Error: token")
