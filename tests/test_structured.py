"""Structured output: every token keeps the request's grammar, and speculation keeps it exactly.

The drafts here are the target's own unconstrained continuation, which the grammar mostly forbids
while the unconstrained target would accept them: only masks on every verify row (the grammar's state
after the drafts before it) make speculative output equal plain constrained decoding. A control with
the masks of the rows after the first taken away shows the equality test catches that."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import llguidance.torch
import pytest
import torch

from blockspec import LLM, SamplingParams
from blockspec.config import ConfigError, EngineConfig
from blockspec.errors import RequestError
from blockspec.sample.processors import apply_bitmask
from blockspec.sampling_params import SamplingError, StructuredOutputsParams
from blockspec.reasoning import ThinkingBudget
from blockspec.structured import Grammar, Masks
from factories import save_drafter_target, save_tiny_tokenizer

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


def with_unconstrained_drafts(llm: LLM, plain: LLM, **params) -> None:
    """Drafts = what the target would say next without the grammar (its greedy continuation; `params`: more
    SamplingParams of that continuation)."""
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
                                                                              ignore_eos=True, **params),
                                  use_tqdm=False)
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

    ending = grammar_ending(Grammar(Refusing()), [16386])
    assert ending.reason == "error" and "\n" not in ending.error and len(ending.error) < 300
    assert ending.error.startswith("the output left its structured-output grammar: Parser Error: token")


# ---------------------------------------------------------------- a thinking model's grammar (reasoning_parser)
ANSWER = StructuredOutputsParams(regex=r"[a-c]{3}-[0-9]{2}")
THOUGHTS = ["hello<think>", "x = 1<think>", "def f():<think>", "The answer<think>"]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory) -> Path:
    """The fixtures' target with <think> and </think> as tokens of its tokenizer."""
    return save_drafter_target(tmp_path_factory.mktemp("thinker"), think=True)


def think_ids(llm: LLM) -> tuple[int, int]:
    vocab = llm.engine.tokenizer.get_vocab()
    return vocab["<think>"], vocab["</think>"]


def thought_then_answer(free: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], int]:
    """What a grammar that starts after the think block gives, built from outputs without one: the output
    without the grammar up to its first </think>, then the constrained output of the prompt and that thought
    (the noise is keyed by position, so a sampled answer draws alike); and the thought's length."""
    _, end = think_ids(free)
    unconstrained = free.generate([prompt], dataclasses.replace(params, structured_outputs=None),
                                  use_tqdm=False)[0].outputs[0].token_ids
    assert end in unconstrained, "the premise: the thought ends within max_tokens"
    thought = unconstrained[: unconstrained.index(end) + 1]
    ids = free.engine.tokenizer.encode(prompt) + thought
    answer = free.generate([{"prompt_token_ids": ids}], dataclasses.replace(params, max_tokens=params.max_tokens
                                                                            - len(thought)), use_tqdm=False)
    return thought + answer[0].outputs[0].token_ids, len(thought)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_reasoning_parsers_grammar_holds_the_answer_after_the_think_block(thinker, parser, temperature):
    """With a reasoning parser the grammar starts after </think>: the thought is the unconstrained output's, the
    answer the constrained output that follows it (vLLM's reasoning_parser with structured outputs)."""
    free = LLM(str(thinker), device="cpu", max_model_len=160)
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser=parser)
    _, end = think_ids(llm)
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=40, logit_bias={end: 1.5},
                            structured_outputs=ANSWER)
    prompts = THOUGHTS + (["no tag: R1 always starts thinking"] if parser == "deepseek_r1" else [])
    got = llm.generate(prompts, params, use_tqdm=False)
    thoughts = []
    for prompt, out in zip(prompts, got):
        want, thought = thought_then_answer(free, prompt, params)
        thoughts.append(thought)
        assert out.outputs[0].token_ids == want, prompt
        answer = out.outputs[0].text.split("</think>", 1)[1]
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", answer) and out.outputs[0].finish_reason == "stop", answer
    assert max(thoughts) >= 3, "the premise: some thought spans several tokens"
    # without the parser the grammar holds the output from its first token
    assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) for t in texts(free.generate(prompts, params, use_tqdm=False)))


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_an_output_may_open_a_think_block_with_its_first_token_only(thinker, parser):
    """An output whose prompt left no block open may open one with its first token (its row allows <think> beside
    the grammar's tokens: qwen3 with no tag in its prompt, either parser after an earlier turn's block), then the
    grammar holds the answer after </think>; later rows never allow <think>. A prompt that closed its block at its
    end (Qwen3's enable_thinking false) is constrained from its first token, <think> biased up as it may be."""
    free = LLM(str(thinker), device="cpu", max_model_len=160)
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser=parser)
    start, end = think_ids(llm)
    opening = SamplingParams(temperature=0, max_tokens=40, logit_bias={start: 30.0, end: 40.0}, structured_outputs=ANSWER)
    earlier = [p + "<think>x</think>turn\n" for p in PROMPTS]  # an earlier turn's block, then more text
    for out in llm.generate(earlier + (PROMPTS if parser == "qwen3" else []), opening, use_tqdm=False):
        assert re.fullmatch(r"<think></think>[a-c]{3}-[0-9]{2}", out.outputs[0].text), out.outputs[0].text
    closed = [p + "<think></think>\n\n" for p in PROMPTS]
    for bias in (30.0, -100.0):
        pushed = SamplingParams(temperature=0, max_tokens=40, logit_bias={start: bias}, structured_outputs=ANSWER)
        got = llm.generate(closed, pushed, use_tqdm=False)
        assert ids(got) == ids(free.generate(closed, pushed, use_tqdm=False))
        assert all(re.fullmatch(r"[a-c]{3}-[0-9]{2}", t) for t in texts(got)), texts(got)
    # a first token of the grammar's (biased above <think>): no later row allows <think>, biased as it is
    a = llm.engine.tokenizer.encode("a")[0]
    late = SamplingParams(temperature=0, max_tokens=40, logit_bias={a: 40.0, start: 30.0}, structured_outputs=ANSWER)
    for out in llm.generate(earlier, late, use_tqdm=False):
        assert re.fullmatch(r"a[a-c]{2}-[0-9]{2}", out.outputs[0].text), out.outputs[0].text


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_across_the_end_of_a_think_block_keep_plain_decodings_output(thinker, temperature, monkeypatch):
    """Drafts are the target's continuation without the grammar: thinking tokens, </think>, then tokens the
    grammar forbids. Verify rows after a drafted </think> get the grammar's masks, so the output is plain
    decoding's; the control takes those masks away where the step starts inside the block (rows of a step that
    began thinking left free), and the forbidden drafts get through."""
    plain = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="qwen3")
    free = LLM(str(thinker), device="cpu", max_model_len=160)
    _, end = think_ids(plain)
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=40, logit_bias={end: 1.5},
                            structured_outputs=ANSWER)
    want = plain.generate(THOUGHTS, params, use_tqdm=False)
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="qwen3",
              speculative_config={"method": "dflash", "model": str(FIXTURES / "dflash"), "num_speculative_tokens": 3,
                                  "adaptive_draft_length": False})
    with_unconstrained_drafts(llm, free, logit_bias={end: 1.5})
    rows, crossed = Grammar.rows, []

    def seen(self, row, drafts):  # steps that verify drafts past a drafted </think>
        fills, opening = rows(self, row, drafts)
        crossed.extend(first for _, first, _ in fills if self.phase == "thinking" and first > row)
        return fills, opening

    monkeypatch.setattr(Grammar, "rows", seen)
    assert ids(llm.generate(THOUGHTS, params, use_tqdm=False)) == ids(want)
    stats = llm.get_stats()
    assert crossed and 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    monkeypatch.setattr(Grammar, "rows", lambda self, row, drafts: ([], None) if self.phase == "thinking"
                        else rows(self, row, drafts))
    broken = llm.generate(THOUGHTS, params, use_tqdm=False)
    assert ids(broken) != ids(want) or any(o.error for o in broken)


def test_a_reasoning_parser_needs_the_tokenizers_think_tokens(target, thinker, tmp_path):
    with pytest.raises(ConfigError, match="reasoning_parser must be one of qwen3, deepseek_r1"):
        EngineConfig(reasoning_parser="r1")
    with pytest.raises(ConfigError, match="the tokenizer has no <think> or </think> token"):
        LLM(str(target), device="cpu", max_model_len=160, reasoning_parser="qwen3")
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="deepseek_r1")
    assert (llm.engine.think.start, llm.engine.think.end) == think_ids(llm)
    wide = save_drafter_target(tmp_path / "wide")  # the 96-id model under a tokenizer whose tags are ids 96, 97
    save_tiny_tokenizer(wide, drop="`~", think=True)
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 96"):
        LLM(str(wide), device="cpu", max_model_len=160, reasoning_parser="qwen3")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_thinking_token_budget_closes_the_block_after_that_many_tokens(thinker, temperature):
    """vLLM's thinking_token_budget: the output thinks k tokens at most, then `</think>` is its only token; the rest
    is what follows such a thought (the noise is keyed by position, so a sampled output draws alike). Here the
    model never closes its block itself (`</think>` biased far down)."""
    free = LLM(str(thinker), device="cpu", max_model_len=160)
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="qwen3")
    _, end = think_ids(llm)
    for k in (0, 1, 3):
        params = SamplingParams(temperature=temperature, seed=4, max_tokens=20, logit_bias={end: -100.0},
                                thinking_token_budget=k)
        for prompt in THOUGHTS:
            got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
            unbounded = dataclasses.replace(params, thinking_token_budget=None)
            thought = free.generate([prompt], unbounded, use_tqdm=False)[0].outputs[0].token_ids[:k] + [end]
            rest = free.generate([{"prompt_token_ids": free.engine.tokenizer.encode(prompt) + thought}],
                                 dataclasses.replace(unbounded, max_tokens=20 - len(thought)), use_tqdm=False)
            assert got == thought + rest[0].outputs[0].token_ids, (prompt, k)
    with_grammar = SamplingParams(temperature=temperature, seed=4, max_tokens=20, logit_bias={end: -100.0},
                                  thinking_token_budget=2, structured_outputs=ANSWER)
    for out in llm.generate(THOUGHTS, with_grammar, use_tqdm=False):
        thought, answer = out.outputs[0].text.split("</think>")
        assert len(out.outputs[0].token_ids) == 2 + 1 + len(answer) and re.fullmatch(r"[a-c]{3}-[0-9]{2}", answer)
    with pytest.raises(RequestError, match="thinking_token_budget needs the engine's reasoning_parser"):
        free.generate(THOUGHTS, params, use_tqdm=False)
    with pytest.raises(SamplingError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)


def test_drafts_past_a_spent_thinking_budget_keep_plain_decodings_output(thinker, monkeypatch):
    """Drafts are the target's greedy continuation without a budget: thinking on past it. The verify row where the
    budget runs out allows `</think>` alone, so the drafts past it are rejected and the output is plain decoding's;
    the control forces only a step's first row, and the drafts past the budget get through."""
    temperature = 0.0  # drafts the target accepts whole until the budget row
    plain = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="qwen3")
    free = LLM(str(thinker), device="cpu", max_model_len=160)
    _, end = think_ids(plain)
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=24, logit_bias={end: -100.0},
                            thinking_token_budget=7)  # runs out inside a step's drafts (1 + 4 + 4 accepted)
    want = plain.generate(THOUGHTS, params, use_tqdm=False)
    llm = LLM(str(thinker), device="cpu", max_model_len=160, reasoning_parser="qwen3",
              speculative_config={"method": "dflash", "model": str(FIXTURES / "dflash"), "num_speculative_tokens": 3,
                                  "adaptive_draft_length": False})
    with_unconstrained_drafts(llm, free, logit_bias={end: -100.0})
    assert ids(llm.generate(THOUGHTS, params, use_tqdm=False)) == ids(want)
    stats = llm.get_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    forced = ThinkingBudget.forced
    monkeypatch.setattr(ThinkingBudget, "forced", lambda self, drafts: [j for j in forced(self, drafts) if j == 0])
    assert ids(llm.generate(THOUGHTS, params, use_tqdm=False)) != ids(want)
