"""What a vLLM user brings over works as they expect: vLLM's LLM(...) options and methods, its
get_metrics() objects, generation_config.json defaults, logprob ranks, and the command line's habits
(positional MODEL, -tp, --block-size, --max-num-batched-tokens, --enforce-eager, --chat-template,
--version, defaults in --help, `--model default`, an interactive chat, readable logprobs)."""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from blockspec import LLM, ConfigError, SamplingError, SamplingParams
from blockspec.config import EngineArgs
from blockspec.cli import main
from blockspec.cli_options import add_model_args, add_sampling_args, build_llm, format_spec_metrics
from blockspec.errors import ConversationError, RequestError
from blockspec.metrics_reader import Counter, Gauge, Histogram, Vector
from factories import DRAFTER_TARGET_KW, save_drafter_target, save_tiny, save_tiny_model_with_tokenizer, save_tiny_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    return save_tiny_model_with_tokenizer(tmp_path_factory.mktemp("text") / "m")


@pytest.fixture(scope="module")
def text_llm(text_dir) -> LLM:
    return LLM(str(text_dir), device="cpu", max_model_len=96)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_drafter_target(tmp_path_factory.mktemp("target") / "t")


def parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_sampling_args(parser)
    args = parser.parse_args(argv)
    args.model = args.model or args.model_tag
    return args


# ---------------------------------------------------------------- LLM(...) options
def test_vllm_options_map_to_the_engine(text_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        llm = LLM(str(text_dir), device="cpu", max_model_len=96, enforce_eager=True, max_num_batched_tokens=32,
                  trust_remote_code=True, enable_prefix_caching=True)
    config = llm.engine.config
    assert config.max_prefill_tokens == 32 and config.enforce_eager
    assert not llm.engine.runner.use_graphs and llm.engine.runner.graph_prefill_tokens == 0
    notes = [r.getMessage() for r in caplog.records]
    assert any(n.startswith("trust_remote_code=True is not needed") for n in notes)
    assert not any("enable_prefix_caching" in n for n in notes)  # honoured, so nothing to warn of
    assert config.enable_prefix_caching and llm.engine.pages.prefix is not None
    assert llm.get_tokenizer() is llm.tokenizer is not None


def test_vllms_spellings_of_dsparks_options_configure_it(tmp_path):
    """vLLM names DSpark's options enable_adaptive_verification and dspark_draft_topk (None: the whole vocabulary);
    they were unknown fields. Both spellings of one option must agree."""
    target = save_drafter_target(tmp_path / "t")
    spec = {"method": "dspark", "model": str(FIXTURES / "dspark_vanilla"), "enable_adaptive_verification": True,
            "dspark_draft_topk": 8}
    config = LLM(str(target), device="cpu", max_model_len=96, speculative_config=spec).speculative_config
    assert config.adaptive_verification and config.markov_top_k == 8
    config = LLM(str(target), device="cpu", max_model_len=96,
                 speculative_config={**spec, "dspark_draft_topk": None}).speculative_config
    assert config.markov_top_k == 0
    with pytest.raises(ConfigError, match="dspark_draft_topk=8 and markov_top_k=4 name the same option"):
        LLM(str(target), device="cpu", speculative_config={**spec, "markov_top_k": 4})


def test_vllm_knobs_without_a_counterpart_are_accepted_with_a_note(text_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="blockspec"):
        LLM(str(text_dir), device="cpu", max_model_len=64, enable_chunked_prefill=False, swap_space=4,
            disable_custom_all_reduce=True, max_seq_len_to_capture=8192)
    notes = " ".join(r.getMessage() for r in caplog.records)
    for name in ("enable_chunked_prefill=False", "swap_space", "disable_custom_all_reduce", "max_seq_len_to_capture"):
        assert f"{name}" in notes and "ignored" in notes, name
    for bad, field in ((dict(swap_space=-1), "swap_space"),
                       (dict(enable_chunked_prefill="yes"), "enable_chunked_prefill"),
                       (dict(max_seq_len_to_capture=0), "max_seq_len_to_capture")):
        with pytest.raises(ConfigError, match=field):
            LLM(str(text_dir), device="cpu", **bad)
    args = parsed([str(text_dir), "--enable-chunked-prefill", "--swap-space", "2", "--max-seq-len-to-capture", "64",
                   "--device", "cpu", "--max-model-len", "64"])
    assert build_llm(args).engine.config.max_prefill_tokens == 4096


def test_probabilistic_drafts_with_an_adaptive_draft_length_are_flagged():
    """Their seeded tokens depend on the timed draft lengths; a pinned K or greedy drafts by sample-and-match
    draw no note."""
    from blockspec.config import EngineArgs

    def notes(**spec) -> list[str]:
        return EngineArgs(speculative_config={"method": "dflash", "model": "d", **spec}).unhonoured()

    assert any("seeded runs may differ" in n for n in notes(draft_sample_method="probabilistic"))
    # greedy drafts under block verification are not sample-and-match either: their seeded tokens depend on K
    assert any("block verification with adaptive_draft_length" in n for n in notes(rejection_sample_method="block"))
    assert notes(draft_sample_method="probabilistic", adaptive_draft_length=False) == notes() == []


def test_a_graphed_engine_prefills_in_graphs_unless_eager(text_dir):
    assert LLM(str(text_dir), device="cpu", max_model_len=96).engine.runner.graph_prefill_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_enforce_eager_captures_no_graph_and_decodes_as_the_graphs_do(target_dir):
    from blockspec.models.runner import CAPTURES

    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    kw = dict(device="cuda", dtype="float32", max_model_len=128, max_num_seqs=4, speculative_config=spec)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    graphed = LLM(str(target_dir), **kw)
    captured = CAPTURES[0]
    eager = LLM(str(target_dir), enforce_eager=True, **kw)
    want = [o.outputs[0].token_ids for o in graphed.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == want and CAPTURES[0] == captured
    assert graphed.engine.proposer.graphs.use_graphs and not eager.engine.proposer.graphs.use_graphs
    assert not eager.engine.runner.use_graphs and eager.engine.runner.graph_prefill_tokens == 0


def test_an_option_blockspec_lacks_is_a_config_error_naming_it(text_dir, text_llm):
    with pytest.raises(ConfigError, match="no option pipeline_parallel_size"):
        LLM(str(text_dir), device="cpu", pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match=r"method 'ngram' not supported; allowed: \('dflash', 'dspark'\)"):
        LLM(str(text_dir), device="cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    # vLLM's generate / chat arguments that ask for nothing blockspec lacks are taken (they were TypeErrors)
    params = SamplingParams(temperature=0, max_tokens=3)
    want = text_llm.generate("ab", params, use_tqdm=False)[0].outputs[0].token_ids
    assert text_llm.generate("ab", params, use_tqdm=False, lora_request=None, priority=[0])[0].outputs[0].token_ids \
        == want
    chat = [{"role": "user", "content": "hi"}]
    assert text_llm.chat(chat, params, use_tqdm=False, lora_request=None, chat_template_content_format="string",
                         mm_processor_kwargs=None)[0].outputs[0].token_ids == \
        text_llm.chat(chat, params, use_tqdm=False)[0].outputs[0].token_ids
    for call, says in ((lambda: text_llm.generate("ab", params, priority=[2]), "priority: blockspec schedules"),
                       (lambda: text_llm.generate("ab", params, lora_request=object()), "lora_request: blockspec"),
                       (lambda: text_llm.chat(chat, params, chat_template_content_format="openai"),
                        "chat_template_content_format 'openai'")):
        with pytest.raises(ConfigError, match=says):
            call()
    with pytest.raises(ConfigError, match="name the same limit"):
        LLM(str(text_dir), device="cpu", max_num_batched_tokens=32, max_prefill_tokens=64)


# ---------------------------------------------------------------- generation_config.json
def write_generation_config(path: Path, **fields) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, **fields}))
    return path


def test_generation_config_sets_the_default_sampling_parameters(tmp_path):
    gen = tmp_path / "gen"
    model = save_tiny_model_with_tokenizer(tmp_path / "own")
    write_generation_config(model, temperature=0.0, top_k=5, repetition_penalty=1.1, max_new_tokens=5)
    write_generation_config(gen, temperature=0.7, top_p=0.8)
    llm = LLM(str(model), device="cpu", max_model_len=96)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_k, d.repetition_penalty, d.max_tokens, d.top_p) == (0.0, 5, 1.1, 5, 1.0)
    out = llm.generate("abc", use_tqdm=False)[0].outputs[0]
    want = llm.generate("abc", SamplingParams(temperature=0, top_k=5, repetition_penalty=1.1, max_tokens=5),
                        use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5 and out.token_ids == want.token_ids
    assert LLM(str(model), device="cpu", max_model_len=96, generation_config="vllm").get_default_sampling_params() \
        == SamplingParams()
    other = LLM(str(model), device="cpu", max_model_len=96, generation_config=str(gen)).get_default_sampling_params()
    assert (other.temperature, other.top_p, other.top_k) == (0.7, 0.8, 0)
    with pytest.raises(ConfigError, match="has no generation_config.json"):
        LLM(str(model), device="cpu", generation_config=str(tmp_path))
    bad = write_generation_config(tmp_path / "bad", temperature="hot")  # named at load, not at a request
    with pytest.raises(ConfigError, match=r"bad/generation_config.json: SamplingParams.temperature='hot' is invalid"):
        LLM(str(model), device="cpu", generation_config=str(bad))


def test_a_generation_config_with_eos_ids_only_changes_no_default(text_llm):
    assert text_llm.get_default_sampling_params() == SamplingParams()


# ---------------------------------------------------------------- chat templates
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{{ suffix | default('') }}"


def test_chat_takes_a_template_and_its_variables(text_llm, tmp_path):
    messages = [{"role": "user", "content": "hi"}]
    tok = text_llm.get_tokenizer()

    def prompt_ids(**kw) -> list[int]:
        return text_llm.chat(messages, GREEDY, use_tqdm=False, **kw)[0].prompt_token_ids

    assert prompt_ids(chat_template=TEMPLATE) == tok.encode("[hi]")
    assert prompt_ids(chat_template=TEMPLATE, chat_template_kwargs={"suffix": "ok"}) == tok.encode("[hi]ok")
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert prompt_ids(chat_template=str(path)) == tok.encode("[hi]")
    assert prompt_ids() == tok.encode("<user>hi\n<assistant>")  # the tokenizer's own


def test_chat_continues_the_final_message(text_llm):
    """vLLM's continue_final_message: the last message is left open (no new assistant turn), so the model
    continues a reply whose first words the caller gave; with add_generation_prompt it is refused, and a
    template that rewrites the final message cannot leave it open: one line each, naming the conversation."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x ="}]
    tok = text_llm.get_tokenizer()
    out = text_llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == tok.encode("<user>hi\n<assistant>x =")
    plain = text_llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    closed = text_llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False)[0]
    assert closed.prompt_token_ids == tok.encode("<user>hi\n<assistant>x =\n")  # the turn ends: the control
    with pytest.raises(RequestError, match="^conversation 0: continue_final_message and add_generation_prompt cannot "
                                           "both be true"):
        text_llm.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)
    upper = "{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}"
    with pytest.raises(RequestError, match="^conversation 0: continue_final_message: the chat template does not "
                                           "render the final message's content as written"):
        text_llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True,
                      chat_template=upper)


def test_chat_template_option_replaces_the_tokenizers(text_dir, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    llm = build_llm(parsed([str(text_dir), "--device", "cpu", "--max-model-len", "96", "--chat-template", str(path)]))
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("[hi]")
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        LLM(str(text_dir), device="cpu", chat_template=str(tmp_path / "missing.jinja"))


def test_chat_template_and_conversation_mistakes_are_one_line(text_llm, text_dir):
    """A template Jinja cannot parse is refused when given, naming its line (it used to surface as a jinja2
    traceback at the first chat); one that fails on the messages, or messages that are no conversation, are
    RequestErrors; `tools` reach the template as vLLM's chat passes them."""
    with pytest.raises(ConfigError, match=r"^chat_template: not a valid Jinja template \(line 1: Unexpected end"):
        text_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                      chat_template="{% for m in messages %}")
    with pytest.raises(ConfigError, match="^chat_template: not a valid Jinja template"):
        LLM(str(text_dir), device="cpu", max_model_len=96, chat_template="{{ messages ")
    failing = "{{ raise_exception('no system role here') }}"
    with pytest.raises(RequestError, match="^conversation 0: the chat template failed on these messages: no system"):
        text_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=failing)
    for bad in ([1, 2], [[{"role": "user"}]]):
        with pytest.raises(RequestError, match=r"^conversation 0: messages must be a non-empty list of"):
            text_llm.chat(bad, GREEDY, use_tqdm=False)
    shown = "{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    out = text_llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template=shown, tools=tools)
    assert out[0].prompt_token_ids == text_llm.get_tokenizer().encode("get_time;hi")


def test_tool_call_histories_and_template_arguments_reach_the_template_as_vllm_passes_them(text_llm):
    """An assistant's tool calls with JSON-text arguments (as OpenAI clients send them) reach the template as
    objects (a template's tojson quoted them again: Llama 3.1's history read '"{\\"city\\": ...}"'); an empty
    tool_calls list is left out; content may be left out beside tool calls; chat_template_kwargs may set
    add_generation_prompt (vLLM's merge), not tokenize; a template failing in its own code is one line."""
    shown = ("{% for m in messages %}{{ m['role'] }}:{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
             "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m['content'] }}{% endif %};{% endfor %}"
             "{% if add_generation_prompt %}A:{% endif %}")
    encode = functools.partial(text_llm.get_tokenizer().encode, add_special_tokens=False)
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "ok", "tool_calls": []}]

    def ids(messages, **kw):
        return text_llm.chat(messages, GREEDY, use_tqdm=False, chat_template=shown, **kw)[0].prompt_token_ids

    assert ids(msgs) == encode('user:hi;assistant:{"city": "Paris"};tool:sunny;assistant:ok;A:')
    assert ids(msgs[:1], chat_template_kwargs={"add_generation_prompt": False}) == encode("user:hi;")
    with pytest.raises(RequestError, match=r"^chat_template_kwargs.tokenize is set by blockspec, not a template"):
        ids(msgs[:1], chat_template_kwargs={"tokenize": False})
    unreadable = {**call, "function": {"name": "weather", "arguments": "{city"}}
    with pytest.raises(ConversationError, match=r"^conversation 0, message 1: tool_calls\[0\].function.arguments "
                                                r"is not JSON \(Expecting property name"):
        ids([msgs[0], {"role": "assistant", "tool_calls": [unreadable]}])
    with pytest.raises(ConversationError, match=r"^conversation 0: the chat template failed on these messages: "
                                                r"TypeError"):
        text_llm.chat(msgs[:1], GREEDY, use_tqdm=False, chat_template="{{ none + 'a' }}")
    # thinking sent back under vLLM's `reasoning` reaches a template as `reasoning_content` (Qwen3's name)
    thought = "{% for m in messages %}{{ m['role'] }}:{{ m.reasoning_content or '' }}|{{ m['content'] }};{% endfor %}"
    turns = [msgs[0], {"role": "assistant", "content": "a", "reasoning": "r"},
             {"role": "assistant", "content": "b", "reasoning_content": "s", "reasoning": "ignored"}]
    got = text_llm.chat(turns, GREEDY, use_tqdm=False, chat_template=thought, add_generation_prompt=False)
    assert got[0].prompt_token_ids == encode("user:|hi;assistant:r|a;assistant:s|b;")


def test_vllm_prompt_and_params_helpers(text_llm, target_dir):
    """vLLM's TokensPrompt / TextPrompt, SamplingParams.clone(), CompletionOutput.finished() and a tqdm class as
    use_tqdm work as there; per-request logits_processors and a prompt's multi_modal_data are refused by name
    (they used to be a TypeError, or silently dropped); stop strings on a model without a tokenizer are refused
    (nothing decodes the text they are matched in; they used to be ignored)."""
    from tqdm import tqdm

    from blockspec.inputs import TextPrompt, TokensPrompt

    ids = text_llm.get_tokenizer().encode("ab")
    bars = []

    class Bar(tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "disable": True})
            bars.append(self)

    outs = text_llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt="ab")], GREEDY, use_tqdm=Bar)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids and len(bars) == 1
    assert outs[0].outputs[0].finished() and outs[0].outputs[0].finish_reason == "length"
    params = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    copy = params.clone()
    copy.logit_bias[3] = -1.0
    assert params.logit_bias == {3: 1.0} and copy.stop_strings == ("x",)
    with pytest.raises(SamplingError, match=r"^SamplingParams.logits_processors=.* per-request logits processors"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(RequestError, match=r"^prompt 0: a prompt dict takes prompt, prompt_token_ids, cache_salt only; "
                                           r"\['multi_modal_data'\] is not supported"):
        text_llm.generate({"prompt": "ab", "multi_modal_data": {"image": None}}, GREEDY, use_tqdm=False)
    bare = LLM(str(target_dir), device="cpu", max_model_len=64)
    with pytest.raises(RequestError, match="stop strings are matched in the output's text and .* has no tokenizer"):
        bare.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, stop="x"), use_tqdm=False)


# ---------------------------------------------------------------- logprobs and metrics
def test_every_top_alternative_has_its_rank(text_llm):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=4, ignore_eos=True)
    out = text_llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert entry[tok].rank == 1  # greedy: the chosen token is the most likely
        alternatives = sorted(entry.values(), key=lambda lp: -lp.logprob)
        assert [lp.rank for lp in alternatives] == [1, 2, 3, 4]


def test_detokenize_false_gives_token_ids_without_text(text_llm):
    """vLLM's detokenize=False: the same tokens and logprobs, but no text is made: the output's text is
    empty and every logprob's decoded_token (sampled and prompt) None; stop strings, which are matched
    in the text, are refused."""
    kw = dict(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    text, ids = (text_llm.generate("hello", SamplingParams(**kw, detokenize=d), use_tqdm=False)[0]
                 for d in (True, False))
    assert ids.prompt_token_ids == text.prompt_token_ids
    for want, got in zip(text.outputs, ids.outputs):
        assert want.text and got.text == "" and got.token_ids == want.token_ids
        assert [{t: lp.logprob for t, lp in e.items()} for e in got.logprobs] == \
            [{t: lp.logprob for t, lp in e.items()} for e in want.logprobs]
        assert all(lp.decoded_token is None for e in got.logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in ids.prompt_logprobs[1:] for lp in e.values())
    assert all(lp.decoded_token is not None for e in text.prompt_logprobs[1:] for lp in e.values())
    with pytest.raises(SamplingError, match=r"SamplingParams\.stop='lo' is invalid; allowed: None with detokenize"):
        SamplingParams(stop="lo", detokenize=False)


def test_best_of_is_n_or_refused(text_llm):
    """vLLM V1 dropped best_of: best_of=n returns the n samples as n alone does; any other value is
    refused by name, not taken as an unknown keyword."""
    kw = dict(n=2, temperature=1.0, seed=5, max_tokens=4, ignore_eos=True)
    plain, best = (text_llm.generate("hi", SamplingParams(**kw, **extra), use_tqdm=False)[0]
                   for extra in ({}, {"best_of": 2}))
    assert [o.token_ids for o in best.outputs] == [o.token_ids for o in plain.outputs]
    with pytest.raises(SamplingError, match=r"SamplingParams\.best_of=3 is invalid; allowed: None or n \(2\)"):
        SamplingParams(**kw, best_of=3)


def test_spaces_between_special_tokens_is_accepted_and_checked(text_llm):
    """vLLM's spaces_between_special_tokens: accepted either way, with the same text (the tokenizers loaded
    here join special tokens without that choice, as vLLM's fast detokenizer does); a value that is not a
    bool is refused by name."""
    kw = dict(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, skip_special_tokens=False)
    on, off = (text_llm.generate("hello", SamplingParams(**kw, spaces_between_special_tokens=v), use_tqdm=False)[0]
               for v in (True, False))
    assert off.outputs[0].text == on.outputs[0].text and off.outputs[0].token_ids == on.outputs[0].token_ids
    with pytest.raises(SamplingError, match=r"SamplingParams\.spaces_between_special_tokens=1 is invalid; allowed: "
                                            r"True or False"):
        SamplingParams(spaces_between_special_tokens=1)


def test_get_metrics_gives_vllms_reader_objects(target_dir, caplog):
    """As vLLM's metrics and speculative-decoding examples read them, disable_log_stats=False included (it was
    refused as an unknown option); True is accepted with a note, since the counters are always kept."""
    spec = {"method": "dflash", "model": str(FIXTURES / "dflash"), "adaptive_draft_length": False}
    llm = LLM(str(target_dir), device="cpu", max_model_len=96, speculative_config=spec, disable_log_stats=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    from blockspec.config import EngineArgs

    assert any(n.startswith("disable_log_stats=True: blockspec keeps its counters")
               for n in EngineArgs(disable_log_stats=True).unhonoured()) and not EngineArgs().unhonoured()
    stats = llm.get_stats()
    by_name = {m.name: m for m in llm.get_metrics()}
    assert stats["num_drafts"] > 0
    for name, key in (("vllm:spec_decode_num_drafts", "num_drafts"), ("vllm:spec_decode_num_draft_tokens",
                      "num_draft_tokens"), ("vllm:spec_decode_num_accepted_tokens", "num_accepted_tokens"),
                      ("vllm:generation_tokens", "num_generated_tokens"), ("vllm:prompt_tokens", "num_prompt_tokens")):
        assert isinstance(by_name[name], Counter) and by_name[name].value == stats[key], name
    assert stats["num_prompt_tokens"] == 4  # the prompt's tokens (the warm-up's are not counted)
    per_pos = by_name["vllm:spec_decode_num_accepted_tokens_per_pos"]
    k = llm.engine.proposer.num_speculative_tokens
    assert isinstance(per_pos, Vector) and len(per_pos.values) == k
    assert per_pos.values[: len(stats["num_accepted_tokens_per_pos"])] == stats["num_accepted_tokens_per_pos"]
    assert isinstance(by_name["vllm:num_requests_running"], Gauge) and by_name["vllm:num_requests_running"].value == 0
    assert per_pos.labels == {"model_name": str(target_dir), "engine": "0"}
    steps = {m.labels["draft_length"]: m.value for m in llm.get_metrics()
             if m.name == "blockspec:spec_decode_policy_steps"}
    assert steps == {str(k): n for k, n in stats["policy_steps"].items()} and steps[str(k)] > 0
    # n copies each read the prompt (vLLM counts a child request's prompt at its first token)
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(n=2, temperature=0.5, max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    assert llm.get_stats()["num_prompt_tokens"] == 4 + 2 * 3
    # vLLM's request histograms and finish reasons: three requests (one, then two copies of one prompt)
    metrics = {(m.name, m.labels.get("finished_reason")): m for m in llm.get_metrics()}
    assert metrics["vllm:request_success", "length"].value == 3 and metrics["vllm:request_success", "stop"].value == 0
    generated = metrics["vllm:request_generation_tokens", None]
    assert isinstance(generated, Histogram) and (generated.count, generated.sum) == (3, 12 + 2 + 2)
    assert list(generated.buckets.values()) == sorted(generated.buckets.values()) and generated.buckets["+Inf"] == 3
    assert (generated.buckets["1.0"], generated.buckets["2.0"], generated.buckets["10.0"]) == (0, 2, 2)
    n = metrics["vllm:request_params_n", None]
    assert (n.count, n.sum) == (2, 3)  # once a request, when its copies all finished
    ttft, e2e = metrics["vllm:time_to_first_token_seconds", None], metrics["vllm:e2e_request_latency_seconds", None]
    assert ttft.count == e2e.count == 3 and 0 < ttft.sum <= e2e.sum
    assert 0 <= metrics["vllm:kv_cache_usage_perc", None].value < 1


def test_no_draft_is_explained():
    assert format_spec_metrics({"num_drafts": 0, "policy_steps": {0: 7}}) == (
        "speculation: configured, but the draft-length policy chose plain decoding for every step "
        "(adaptive_draft_length=false pins K)")
    assert "no step drafted" in format_spec_metrics({"num_drafts": 0, "policy_steps": {}})


# ---------------------------------------------------------------- command line
def test_model_as_argument_or_flag(text_dir, capsys):
    base = ["--prompt", "ab", "--max-tokens", "3", "--device", "cpu", "--max-model-len", "96"]
    assert main(["generate", str(text_dir), *base]) == 0
    positional = capsys.readouterr().out
    assert main(["generate", "--model", str(text_dir), *base]) == 0
    assert capsys.readouterr().out == positional
    assert main(["generate", str(text_dir), "--model", "other", *base]) == 2
    assert "two models given" in capsys.readouterr().err
    assert main(["generate", *base]) == 2
    assert "give the target model" in capsys.readouterr().err


def test_command_line_mistakes_a_vllm_user_makes_are_named(text_dir, tmp_path, capsys, monkeypatch):
    """vLLM's --flag_name spelling is taken; token-id prompts given to chat (they reached the template as the
    dict's Python text), chat with stdin closed (an AttributeError), a --tokenizer directory without tokenizer
    files (blamed on the model) and --enable-auto-tool-choice without a parser (vLLM refuses it) are one-line
    errors."""
    import sys

    base = ["--device", "cpu", "--max-tokens", "2"]
    assert main(["generate", str(text_dir), "--max_model_len", "96", "--prompt", "ab", *base]) == 0
    assert capsys.readouterr().out
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"prompt_token_ids": [5, 6, 7]}\n')
    assert main(["chat", str(text_dir), "--prompts-file", str(ids), *base]) == 2
    assert "chat takes text prompts; prompt 0 holds token ids" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["chat", str(text_dir), *base]) == 2
    assert "reads the conversation from stdin, which is closed" in capsys.readouterr().err
    assert main(["generate", str(text_dir), "--tokenizer", str(tmp_path), "--prompt", "ab", *base]) == 2
    assert f"tokenizer '{tmp_path}': no tokenizer files there" in capsys.readouterr().err
    assert main(["serve", str(text_dir), "--enable-auto-tool-choice", "--port", "0"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert "no room left" in format_spec_metrics({"num_drafts": 0, "policy_steps": {0: 2, 1: 1}})
    assert main(["generate", str(text_dir), "--speculative-config", "{}", "--prompt", "ab", *base]) == 2
    assert "--speculative-config {} names no drafter" in capsys.readouterr().err  # it ran plain without a word
    # an error in an option's own name also names the flag typed (kv_page_size alone answered --block-size 0)
    assert main(["generate", str(text_dir), "--block-size", "0", "--prompt", "ab", *base]) == 2
    assert "kv_page_size must be an integer in [1, 1024], got 0 (--block-size / --kv-page-size)" in \
        capsys.readouterr().err
    assert main(["generate", str(text_dir), "--prompt", "ab", "--device", "cpu", "--max-tokens", "-5"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(--max-tokens)")


def test_vllm_flag_names_reach_the_engine(text_dir):
    args = parsed([str(text_dir), "-tp", "1", "--block-size", "16", "--max-num-batched-tokens", "48",
                   "--enforce-eager", "--device", "cpu", "--max-model-len", "96"])
    assert (args.tensor_parallel_size, args.kv_page_size, args.max_prefill_tokens) == (1, 16, 48)
    assert parsed([str(text_dir), "-tp", "2"]).tensor_parallel_size == 2
    config = build_llm(args).engine.config
    assert (config.kv_page_size, config.max_prefill_tokens, config.enforce_eager) == (16, 48, True)
    flags = parsed([str(text_dir), "--draft-model", "d", "--no-adaptive-draft-length"])
    from blockspec.cli_options import speculative_config

    assert speculative_config(flags)["adaptive_draft_length"] is False
    assert "adaptive_draft_length" not in speculative_config(parsed([str(text_dir), "--draft-model", "d"]))
    # no method given: the checkpoint's family (a DSpark drafter was taken for DFlash, then refused), else DFlash
    assert [speculative_config(parsed([str(text_dir), "--draft-model", d]))["method"]
            for d in (str(FIXTURES / "dspark_vanilla"), str(FIXTURES / "dflash"), "org/hub-id")] == \
        ["dspark", "dflash", "dflash"]


def test_every_engine_limit_has_its_flag(text_dir):
    """README's options table promises a `--flag` of the same name for each of `LLM`'s engine limits."""
    import dataclasses

    from blockspec.config import EngineConfig

    args = parsed([str(text_dir), "--device", "cpu"])
    missing = [f.name for f in dataclasses.fields(EngineConfig) if not hasattr(args, f.name)]
    assert missing == []
    config = build_llm(parsed([str(text_dir), "--device", "cpu", "--max-model-len", "96",
                               "--graph-prefill-tokens", "0"])).engine.config
    assert config.graph_prefill_tokens == 0


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == "blockspec 0.1.0"
    for command in ("generate", "chat"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for default in ("(default: 64)", "(default: 4096)", "(default: auto)", "(default: 0.0)", "(default: the "
                        "model's)"):
            assert default in text, (command, default)


def test_default_names_the_embedded_pair(capsys):
    assert main(["generate", "default", "--draft-model", "default", "--prompt", "def f(x):", "--max-tokens", "8",
                 "--device", "cpu", "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "--- 0 [length]" in out and "speculation:" in err


def test_llm_default_names_the_embedded_pair_and_a_bad_prompt_dict_is_named():
    llm = LLM("default", device="cpu", speculative_config={"method": "dspark", "model": "default"})
    assert llm.engine.proposer is not None
    out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(RequestError, match=r"a dict with 'prompt' or 'prompt_token_ids'; got a dict with keys "
                                           r"\['promt'\]"):
        llm.generate([{"promt": "def f(x):"}], SamplingParams(max_tokens=2), use_tqdm=False)
    with LLM("default", device="cpu", tensor_parallel_size=2) as ranks:  # the rank group resolves it alike
        out = ranks.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_a_method_alone_takes_the_embedded_drafter_and_elsewhere_asks_for_one(target_dir, capsys):
    """`--speculative-method` with the embedded target speculates with that family's embedded drafter; with another
    target, or with a speculative option but no method, the error names --draft-model."""
    from blockspec.cli_options import speculative_config

    assert main(["generate", "default", "--speculative-method", "dspark", "--prompt", "def f(x):", "--max-tokens",
                 "8", "--device", "cpu", "--ignore-eos"]) == 0
    assert "speculation:" in capsys.readouterr().err
    args = argparse.Namespace(model="default", speculative_config=None, draft_model=None, adaptive_draft_length=None,
                              speculative_method="dspark", num_speculative_tokens=None, draft_sample_method=None,
                              rejection_sample_method=None)
    assert speculative_config(args)["model"].endswith("assets/default/dspark")
    for model, method in ((str(target_dir), "dflash"), ("default", None)):
        argv = ["generate", model, "--prompt", "x", "--device", "cpu", "--no-adaptive-draft-length"]
        assert main(argv + (["--speculative-method", method] if method else [])) == 2
        assert "--draft-model" in capsys.readouterr().err


def test_plain_steps_only_are_explained(target_dir, capsys, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [5, 6, 7, 8]}\n')
    # two tokens: the prefill's, then one decode step, which the adaptive policy takes plain (it times the
    # plain step first)
    assert main(["generate", str(target_dir), "--prompts-file", str(prompts), "--draft-model",
                 str(FIXTURES / "dflash"), "--device", "cpu", "--max-tokens", "2", "--ignore-eos"]) == 0
    assert ("speculation: configured, but the draft-length policy chose plain decoding for every step "
            "(adaptive_draft_length=false pins K)") in capsys.readouterr().err


def test_logprobs_print_text_logprob_rank_and_alternatives(text_dir, capsys):
    assert main(["generate", str(text_dir), "--prompt", "ab", "--max-tokens", "3", "--logprobs", "2", "--device",
                 "cpu", "--ignore-eos"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == 3
    for line in lines:
        token, rest = line.strip().split(" ", 1)
        assert token.startswith("'") and "(rank 1) | top 2: " in rest
        assert len(rest.split("| top 2: ")[1].split(", ")) == 2


def test_chat_keeps_the_conversation(text_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n\nagain\n"))
    args = [str(text_dir), "--max-tokens", "4", "--device", "cpu", "--max-model-len", "96", "--ignore-eos"]
    assert main(["chat", *args]) == 0
    out, err = capsys.readouterr()
    llm = LLM(str(text_dir), device="cpu", max_model_len=96)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "again"}], params, use_tqdm=False)[0].outputs[0].text
    assert out == f"{first}\n{second}\n" and "tokens in" in err


def test_chat_takes_a_system_prompt_and_template_variables(text_dir, capsys):
    """`--system-prompt` opens each conversation and `--chat-template-kwargs` reaches the template (Qwen3's
    enable_thinking could not be turned off from the command line); outside a chat they are refused."""
    args = [str(text_dir), "--prompt", "hi", "--system-prompt", "be brief", "--chat-template", TEMPLATE,
            "--chat-template-kwargs", '{"suffix": "!"}', "--max-tokens", "4", "--device", "cpu", "--max-model-len",
            "96", "--ignore-eos"]
    assert main(["chat", *args]) == 0
    out = capsys.readouterr().out
    llm = LLM(str(text_dir), device="cpu", max_model_len=96, chat_template=TEMPLATE)
    want = llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False,
                    chat_template_kwargs={"suffix": "!"})[0]
    assert want.prompt_token_ids == llm.get_tokenizer().encode("[be brief][hi]!")
    assert want.outputs[0].text in out
    assert main(["generate", *args]) == 2
    assert "--system-prompt and --chat-template-kwargs shape a conversation" in capsys.readouterr().err


def test_chat_ends_at_ctrl_c_and_a_turn_too_long_is_dropped(text_dir, capsys, monkeypatch):
    lines = iter(["x" * 200 + "\n", "hi\n"])  # the first cannot fit max_model_len 96; then Ctrl-C

    def readline() -> str:
        line = next(lines, None)
        if line is None:
            raise KeyboardInterrupt
        return line

    monkeypatch.setattr("sys.stdin", io.StringIO())
    monkeypatch.setattr("sys.stdin.readline", readline)
    assert main(["chat", str(text_dir), "--max-tokens", "2", "--device", "cpu", "--max-model-len", "96"]) == 0
    out, err = capsys.readouterr()
    llm = LLM(str(text_dir), device="cpu", max_model_len=96)
    answer = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2),
                      use_tqdm=False)[0].outputs[0].text  # the second turn alone: the first was dropped
    assert out == answer + "\n" and "error: " in err and "max_model_len" in err and "tokens in" in err


def test_chat_with_prompts_answers_each_alone(text_dir, capsys):
    assert main(["chat", str(text_dir), "--prompt", "hello", "--prompt", "again", "--max-tokens", "2", "--device",
                 "cpu"]) == 0
    assert capsys.readouterr().out.count("--- ") == 2


# ---------------------------------------------------------------- hub ids: revision, download_dir
def hub_cache(root: Path, repo: str, snapshots: dict[str, Path], refs: dict[str, str]) -> Path:
    """A Hugging Face cache holding `repo` at the given commits (each a copy of a directory) and refs."""
    base = root / ("models--" + repo.replace("/", "--"))
    for commit, source in snapshots.items():
        shutil.copytree(source, base / "snapshots" / commit)
    (base / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (base / "refs" / ref).write_text(commit)
    return root


def test_hub_ids_load_at_a_revision_from_a_download_dir(tmp_path, monkeypatch):
    """vLLM's revision, tokenizer_revision and download_dir (offline: from the given cache): each revision
    is its own weights; speculative_config's revision picks the drafter's; an unknown one is named."""
    import huggingface_hub.constants

    from blockspec.errors import ModelLoadError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    old, new = ("a" * 40, save_drafter_target(tmp_path / "m0", tokenizer=True)), ("b" * 40, tmp_path / "m1")
    save_tiny(new[1], "qwen3", seed=1, **DRAFTER_TARGET_KW)
    save_tiny_tokenizer(new[1], drop="`~")
    cache = hub_cache(tmp_path / "cache", "org/tiny", dict([old, new]), {"main": new[0], "v1": old[0]})
    hub_cache(cache, "org/draft", {"c" * 40: FIXTURES / "dflash"}, {"v1": "c" * 40})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def tokens(model: str, **kw) -> list[int]:
        llm = LLM(model, device="cpu", dtype="float32", max_model_len=64, **kw)
        return list(llm.generate(["abc"], params, use_tqdm=False)[0].outputs[0].token_ids)

    assert tokens("org/tiny", download_dir=str(cache), revision="v1") == tokens(str(old[1]))
    assert tokens("org/tiny", download_dir=str(cache)) == tokens(str(new[1])) != tokens(str(old[1]))
    assert tokens("org/tiny", download_dir=str(cache), revision=old[0], tokenizer="org/tiny",
                  tokenizer_revision="v1") == tokens(str(old[1]))
    spec = {"method": "dflash", "model": "org/draft", "revision": "v1"}
    assert tokens("org/tiny", download_dir=str(cache), revision="v1", speculative_config=spec) == tokens(str(old[1]))
    # the method left out: the drafter's config.json, fetched from the download dir at its revision, names it
    hub_cache(cache, "org/spark", {"d" * 40: FIXTURES / "dspark_vanilla"}, {"v1": "d" * 40})
    for drafter, method in (("org/draft", "dflash"), ("org/spark", "dspark")):
        args = EngineArgs(download_dir=str(cache), speculative_config={"model": drafter, "revision": "v1"})
        assert args.speculative_config["method"] == method
    with pytest.raises(ModelLoadError, match=r"model 'org/tiny' at revision 'v2' is not a local directory"):
        LLM("org/tiny", device="cpu", download_dir=str(cache), revision="v2")
    with pytest.raises(ModelLoadError, match=r"dflash drafter 'org/draft' is not a local directory"):
        LLM("org/tiny", device="cpu", download_dir=str(cache), speculative_config={"method": "dflash",
                                                                                   "model": "org/draft"})
    args = parsed(["org/tiny", "--revision", "v1", "--download-dir", str(cache), "--device", "cpu",
                           "--dtype", "float32", "--max-model-len", "64"])
    assert list(build_llm(args).generate(["abc"], params, use_tqdm=False)[0].outputs[0].token_ids) == tokens(str(old[1]))


def test_a_hub_generation_config_is_read_from_the_download_dir(tmp_path, monkeypatch):
    """generation_config given as a hub id is fetched as the model is, from the run's download dir (offline: the
    given cache); it ignored download_dir and looked in the default cache."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = tmp_path / "gen"
    source.mkdir()
    (source / "generation_config.json").write_text('{"temperature": 0.25, "top_k": 7}')
    cache = hub_cache(tmp_path / "cache", "org/gen", {"e" * 40: source}, {"main": "e" * 40})
    llm = LLM(str(save_drafter_target(tmp_path / "m")), device="cpu", download_dir=str(cache),
              generation_config="org/gen")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.25, 7)


def test_the_hub_token_reaches_the_download(monkeypatch):
    import huggingface_hub

    from blockspec.errors import ModelLoadError

    seen = {}

    def refuse(**kw):
        seen.update(kw)
        raise PermissionError("gated")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelLoadError, match=r"'org/gated' at revision 'r1' .*PermissionError: gated"):
        LLM("org/gated", device="cpu", hf_token="hf_abc", revision="r1", download_dir="/tmp/d")
    assert (seen["token"], seen["revision"], seen["cache_dir"], seen["repo_id"]) == ("hf_abc", "r1", "/tmp/d", "org/gated")


def test_a_failed_hub_fetch_is_one_line(monkeypatch):
    """huggingface_hub's error for a repo neither reachable nor cached puts its advice on a second line; the load's
    error keeps it on the first."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from blockspec.errors import ModelLoadError

    def unreachable(**kw):
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened "
                                      "while trying to locate the files on the Hub.")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **kw: None)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelLoadError) as info:
        LLM("org/absent", device="cpu")
    assert str(info.value) == ("model 'org/absent' is not a local directory and could not be fetched from the Hugging "
                               "Face hub: LocalEntryNotFoundError: Got: ConnectError: [Errno -2] Name or service not "
                               "known An error happened while trying to locate the files on the Hub.")


@pytest.mark.parametrize("files, weights", [
    (["config.json", "model.safetensors", "pytorch_model.bin", "training_args.bin"], ["*.safetensors"]),
    (["config.json", "pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"], ["pytorch_model*.bin"]),
    (None, ["*.safetensors", "pytorch_model*.bin"]),  # the listing failed (offline): the cache has what it has
])
def test_a_hub_download_fetches_one_weights_format(monkeypatch, tmp_path, files, weights):
    """A repo with safetensors and .bin weights is fetched in safetensors alone (both doubled the download),
    one with .bin alone in .bin; other .bin files (training state) never. The listing asks the hub once, at the
    revision and with the token: offline it fails at once and the download reads the cache (a listing that
    retried took 23 s to give up)."""
    from types import SimpleNamespace

    import huggingface_hub

    from blockspec.models.loader import HUB_PATTERNS, resolve_model_dir

    asked = []

    def info(self, repo_id, revision=None, token=None):
        asked.append((repo_id, revision, token))
        if files is None:
            raise OSError("offline")
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files])

    seen = {}
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: seen.update(kw) or str(tmp_path))
    assert resolve_model_dir("org/m", revision="r1", token="hf_t") == tmp_path
    assert seen["allow_patterns"] == HUB_PATTERNS + weights
    assert asked == [("org/m", "r1", "hf_t")]


@pytest.mark.parametrize("online", [True, False])
def test_a_hub_drafters_family_is_read_from_its_config_alone(monkeypatch, tmp_path, online):
    """With no method given, a hub drafter's family comes from its config.json, fetched alone at the revision, into
    the download dir, with the token; offline (nothing cached) the hub is asked once and the method is DFlash, the
    drafter's own load then naming the cause."""
    import huggingface_hub

    from blockspec.config import infer_method

    (tmp_path / "config.json").write_text((FIXTURES / "dspark_vanilla" / "config.json").read_text())
    asked = []

    def snapshot(**kw):
        asked.append(kw)
        if not online:
            raise OSError("offline")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)
    assert infer_method("org/drafter", revision="r1", download_dir="/tmp/d", token="hf_t") == \
        ("dspark" if online else "dflash")
    assert asked == [dict(repo_id="org/drafter", allow_patterns=["config.json"], revision="r1", cache_dir="/tmp/d",
                          token="hf_t")]


# ---------------------------------------------------------------- vLLM's conventions
def test_sampling_params_take_vllms_conventions(text_dir, text_llm):
    """seed=-1 is no seed, logprobs=True is 1, NumPy scalars are numbers (each was refused, or -1 a fixed
    seed); logprobs=-1 is the whole vocabulary within the engine's max_logprobs; output_kind and extra_args
    are taken, flat_logprobs=True refused by name."""
    import numpy as np

    from blockspec.sampling_params import RequestOutputKind

    assert SamplingParams(seed=-1).seed is None
    assert (SamplingParams(logprobs=True).logprobs, SamplingParams(prompt_logprobs=True).prompt_logprobs) == (1, 1)
    numpy = SamplingParams(temperature=np.float32(0.5), top_k=np.int32(3), max_tokens=np.int64(5), seed=np.int64(4),
                           stop_token_ids=[np.int64(9)], logit_bias={np.int64(3): np.float64(1.5)}, ignore_eos=True)
    python = SamplingParams(temperature=0.5, top_k=3, max_tokens=5, seed=4, stop_token_ids=[9], logit_bias={3: 1.5},
                            ignore_eos=True)
    assert [type(v) for v in (numpy.temperature, numpy.top_k, numpy.max_tokens, numpy.seed,
                              numpy.stop_token_ids[0])] == [float, int, int, int, int]
    assert text_llm.generate("ab", numpy, use_tqdm=False)[0].outputs[0].token_ids == \
        text_llm.generate("ab", python, use_tqdm=False)[0].outputs[0].token_ids
    kept = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, extra_args={"plugin": 1}, max_tokens=3,
                          temperature=0)
    assert text_llm.generate("ab", kept, use_tqdm=False)[0].outputs[0].token_ids == \
        text_llm.generate("ab", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(SamplingError, match=r"^SamplingParams\.flat_logprobs=True is invalid"):
        SamplingParams(flat_logprobs=True)
    with pytest.raises(SamplingError, match=r"^prompt 0: SamplingParams\.logprobs=-1 asks for \d+ logprobs a token; the "
                                            r"engine's max_logprobs is 20"):
        text_llm.generate("ab", SamplingParams(logprobs=-1, max_tokens=2), use_tqdm=False)
    every = LLM(str(text_dir), device="cpu", max_model_len=96, max_logprobs=-1)
    vocab = every.engine.vocab_size
    out = every.generate("abc", SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=2, temperature=0),
                         use_tqdm=False)[0]
    assert [len(e) for e in out.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(e) == vocab for e in out.prompt_logprobs[1:])
    assert out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].rank == 1
    ids = text_llm.generate({"prompt_token_ids": list(np.array([5, 6, 7]))}, SamplingParams(max_tokens=1),
                            use_tqdm=False)[0].prompt_token_ids
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)  # NumPy's ids come back as Python ints


def test_chat_takes_vllms_positional_order_and_names_bad_arguments(text_llm):
    """vLLM's chat(messages, sampling_params, use_tqdm, lora_request, chat_template, chat_template_content_format,
    add_generation_prompt, ...): a script passing them by position gets what vLLM gives (the fourth was
    add_generation_prompt, so `chat(conv, sp, False, None)` dropped the generation prompt); arguments of the
    wrong type are one-line errors (they were a TypeError and a transformers traceback)."""
    conv = [{"role": "user", "content": "hi"}]
    opened = text_llm.chat(conv, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert text_llm.chat(conv, GREEDY, False, None)[0].prompt_token_ids == opened
    closed = text_llm.chat(conv, GREEDY, False, None, None, "auto", False)[0].prompt_token_ids
    assert closed == text_llm.chat(conv, GREEDY, use_tqdm=False, add_generation_prompt=False)[0].prompt_token_ids
    assert closed != opened
    assert text_llm.chat(conv, GREEDY, use_tqdm=False, tokenization_kwargs={})[0].prompt_token_ids == opened
    for kw, says in (({"chat_template_kwargs": "x"}, "^chat_template_kwargs must be a dict"),
                     ({"tools": "x"}, "^tools must be a list of tool definitions"),
                     ({"tokenization_kwargs": {"truncation": True}}, r"^tokenization_kwargs \['truncation'\]")):
        with pytest.raises(ConfigError, match=says):
            text_llm.chat(conv, GREEDY, use_tqdm=False, **kw)
    # current vLLM's place for truncate_prompt_tokens: tokenization_kwargs, as SamplingParams' keeps the last k
    cut = text_llm.chat(conv, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 3})
    assert cut[0].prompt_token_ids == opened[-3:]
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    assert text_llm.generate(prompt, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2})[0] \
        .prompt_token_ids == [8, 9]
    with pytest.raises(ConfigError, match="truncate_prompt_tokens=2 and SamplingParams.truncate_prompt_tokens=3 "
                                          "disagree"):
        text_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, truncate_prompt_tokens=3),
                          use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 2})


def test_vllms_llm_names_are_taken(text_dir):
    """LLM(block_size=..., served_model_name=..., tokenizer_mode="auto", task="generate") as vLLM scripts pass
    them (each was refused as an unknown option); values blockspec cannot honour are refused by name."""
    llm = LLM(str(text_dir), device="cpu", max_model_len=96, block_size=16, served_model_name=["svc", "alias"],
              tokenizer_mode="auto", task="generate", runner="generate")
    assert llm.engine.config.kv_page_size == 16
    assert {m.labels["model_name"] for m in llm.get_metrics()} == {"svc"}
    for kw, says in (({"block_size": 16, "kv_page_size": 32}, "block_size=16 and kv_page_size=32 name the same"),
                     ({"tokenizer_mode": "slow"}, "tokenizer_mode 'slow' is not supported"),
                     ({"task": "embed"}, "task 'embed' is not supported"),
                     ({"served_model_name": ""}, "served_model_name must be a non-empty string")):
        with pytest.raises(ConfigError, match=says):
            LLM(str(text_dir), device="cpu", max_model_len=96, **kw)


def test_skip_reading_prefix_cache_prefills_the_whole_prompt(text_dir):
    """vLLM's skip_reading_prefix_cache: a prompt whose start prefix caching remembers is prefilled whole, with
    the same output; without it the remembered pages are mapped in."""
    llm = LLM(str(text_dir), device="cpu", max_model_len=96, block_size=8, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(5, 45))}
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    skipped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  skip_reading_prefix_cache=True), use_tqdm=False)[0]
    cached = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert skipped.num_cached_tokens == 0 and cached.num_cached_tokens >= 32
    assert skipped.outputs[0].token_ids == cached.outputs[0].token_ids == first.outputs[0].token_ids
