"""The command line: generate with and without a drafter, errors as one line, help texts."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from blockspec.cli import main
from blockspec.config import ConfigError
from blockspec.assets import PAIR
from factories import save_drafter_target, save_tiny, save_tiny_model_with_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "drafters"


def test_generate_prints_text_and_speed(tmp_path, capsys):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--max-tokens", "8",
                 "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "--- 0 [length]" in out and "tokens in" in err


def test_generate_with_drafter_prints_speculation_metrics(tmp_path, capsys):
    path = save_drafter_target(tmp_path / "t")
    prompts = tmp_path / "p.jsonl"  # this checkpoint has no tokenizer: prompts as token ids
    prompts.write_text('{"prompt_token_ids": [5, 6, 7, 8]}\n{"prompt_token_ids": [9, 10]}\n')
    assert main(["generate", "--model", str(path), "--prompts-file", str(prompts), "--draft-model",
                 str(FIXTURES / "dflash"), "--device", "cpu", "--max-tokens", "12", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "speculation: mean acceptance length" in err and "per-position acceptance" in err
    assert "time split: draft" in err


def test_text_prompt_without_tokenizer_is_one_line(tmp_path, capsys):
    path = save_tiny(tmp_path / "t", "qwen3", seed=0)
    assert main(["generate", "--model", str(path), "--prompt", "x", "--device", "cpu"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("flags, tokens", [([], 3), (["--max-tokens", "5"], 5), (["--generation-config", "vllm"], 128)])
def test_generate_takes_unset_sampling_flags_from_generation_config(tmp_path, capsys, flags, tokens):
    """As LLM.generate does: the file's max_new_tokens where no --max-tokens is given (it used to log the
    file's values and decode with the flags' defaults), the command line's 128 where neither sets it."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    (path / "generation_config.json").write_text('{"max_new_tokens": 3, "temperature": 0.0}')
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--ignore-eos", "--device", "cpu",
                 *flags]) == 0
    assert f"--- {tokens} tokens in" in capsys.readouterr().err


def test_generate_without_a_prompt_is_a_usage_error(capsys):
    assert main(["generate", "default", "--device", "cpu"]) == 2  # as argparse's own usage errors
    assert "error: give at least one --prompt or --prompts-file" in capsys.readouterr().err


def test_bad_model_path_is_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


def test_invalid_sampling_flag_is_one_line(tmp_path, capsys):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "x", "--top-p", "1.5", "--device", "cpu"]) == 2
    assert "top_p" in capsys.readouterr().err


def test_a_speculative_config_field_of_the_wrong_type_is_one_line(tmp_path, capsys):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "x", "--device", "cpu", "--speculative-config",
                 '{"method": "dspark", "model": "x", "confidence_threshold": "high"}']) == 2
    err = capsys.readouterr().err
    assert "speculative_config.confidence_threshold must be a number in [0, 1), got 'high'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
@pytest.mark.parametrize("value, says", [("{bad", "not valid JSON"), ("[1]", "must be a JSON object")])
def test_speculative_config_that_is_no_json_object_is_refused_by_name(command, value, says, capsys):
    """Before any model loads (a server's included): the option, what is wrong and the value, in one line."""
    with pytest.raises(SystemExit) as exc:
        main([command, *(["default"] if command != "bench" else []), "--speculative-config", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and err.startswith(f"blockspec {command}: error: argument --speculative-config: {says}")
    assert repr(value) in err


needs_pair = pytest.mark.skipif(not (PAIR / "target" / "config.json").is_file(), reason="embedded pair not installed")
DEMO = ["demo", "--num-prompts", "2", "--max-tokens", "8", "--device", "cpu"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@needs_pair
def test_demo_colours_only_a_terminal_without_no_color(monkeypatch, capsys):
    """Into a pipe the demo writes no ANSI codes, nor on a terminal with NO_COLOR set; on a terminal it
    colours the code (the control that shows the check can fail)."""
    assert main(DEMO) == 0
    piped = capsys.readouterr().out
    assert "\x1b[" not in piped and "=== prompt 2 of 2 ===" in piped
    for no_color, coloured in (("1", False), ("", True)):
        monkeypatch.setenv("NO_COLOR", no_color)
        terminal = Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        assert main(DEMO) == 0
        assert ("\x1b[1m" in terminal.getvalue()) is coloured


@needs_pair
def test_demo_runs_one_request_at_a_time_in_alternating_rounds(monkeypatch, capsys):
    """Each timed generate call carries one prompt (batch 1); after the choice of prompts and a warm-up of
    each path, round 1 runs plain then speculative, round 2 speculative then plain; the summary gives
    both tok/s and the speedup's spread or says there were no drafts."""
    from blockspec.llm import LLM

    calls = []
    real = LLM.generate

    def generate(self, prompts, params, use_tqdm=True):
        calls.append((len(prompts), "spec" if params.use_speculation else "plain"))
        assert self.engine.config.max_num_seqs == 1  # the engine serves one request at a time
        return real(self, prompts, params, use_tqdm=use_tqdm)

    monkeypatch.setattr(LLM, "generate", generate)
    assert main(DEMO) == 0
    # the choice of prompts the target continues (one greedy token past the first, plain), the warm-up, the rounds
    assert calls == [(4, "plain"), (1, "plain"), (1, "spec"), (1, "plain"), (1, "spec"), (1, "spec"), (1, "plain")]
    out = capsys.readouterr().out
    assert "plain:       16 tokens in" in out and "speculative: 16 tokens in" in out
    assert out.count("x), acceptance length ") + out.count("x), no drafts") == 2  # each round's own
    assert "interleaved rounds, one prompt each, min" in out or "no drafts: no decode step had room" in out


@needs_pair
@pytest.mark.parametrize("flag, budget", [([], True), (["--no-adaptive-verification"], False)])
def test_the_demo_lets_dspark_confidence_choose_what_to_verify(monkeypatch, capsys, flag, budget):
    """DSpark's confidence budget is on in the CPU demo (the drafter as designed) and off on request, when every
    step verifies the whole block."""
    from blockspec.llm import LLM

    engines = []
    real = LLM.generate

    def generate(self, prompts, params, use_tqdm=True):
        engines.append(self.engine)
        return real(self, prompts, params, use_tqdm=use_tqdm)

    monkeypatch.setattr(LLM, "generate", generate)
    assert main(DEMO + flag) == 0
    proposer = engines[-1].proposer
    assert proposer.cfg.adaptive_verification is budget
    assert (proposer.cost_table is not None) is budget
    assert "outputs identical to plain decoding: yes" in capsys.readouterr().out


def test_the_demo_budgets_verification_on_the_cpu_unless_told():
    from blockspec.demo import budget_on

    assert budget_on(None, "cpu") and not budget_on(False, "cpu") and budget_on(True, "cpu")
    assert not budget_on(None, "cuda") and budget_on(True, "cuda")


def test_the_demo_takes_prompts_the_target_continues(tmp_path):
    """A candidate that the target ends at its first token is passed over, in order."""
    from blockspec.demo import continued_prompts
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    llm = LLM(str(path), device="cpu", seed=0, max_num_seqs=1)
    candidates = ["def f(x):", "import os", "class A:", "x = 1"]
    first = [o.outputs[0].token_ids[0] for o in llm.generate(candidates, SamplingParams(temperature=0, max_tokens=1),
                                                             use_tqdm=False)]
    llm.engine.output.eos_ids = [first[1]]  # the second candidate (and any that starts alike) now ends at once
    kept = continued_prompts(llm, candidates, 3)
    assert len(set(first)) > 1  # the check below has candidates to keep
    assert candidates[1] not in kept and kept == [c for c, t in zip(candidates, first) if t != first[1]][:3]
    assert kept


def test_demo_summary_gives_the_speedup_spread_or_says_no_drafts():
    from blockspec.demo import Round, summary

    rounds = [Round(100, 1.0, 100, 1.0 / 1.1, True), Round(100, 1.0, 100, 1.0 / 1.2, True)]
    drafted = {"num_drafts": 4, "mean_acceptance_length": 2.5, "mean_draft_length": 3.0,
               "per_position": [0.75, 0.5, None]}
    lines = summary(rounds, drafted)
    assert "4 of 192 decode steps drafted (for the others, the draft-length policy chose plain decoding" in lines[0]
    assert "per-position acceptance" in lines[1] and lines[1].endswith("0.75 0.50 -")
    assert "4 of 192 decode steps drafted (the others had no room for a draft before the token limit)" in \
        summary(rounds, drafted, adaptive=False)[0]
    assert lines[-1] == ("speedup 1.15x (median of 2 interleaved rounds, one prompt each, min 1.10x, max 1.20x; "
                         "2 of 2 faster); outputs identical to plain decoding: yes")
    mixed = summary([rounds[0], Round(100, 1.0, 100, 1.0 / 0.9, False)], drafted)
    assert mixed[-1] == ("speedup 1.00x (median of 2 interleaved rounds, one prompt each, min 0.90x, max 1.10x; "
                         "1 of 2 faster); outputs identical to plain decoding: NO")
    ended = summary(rounds + [Round(1, 0.1, 1, 0.2, True)], drafted)  # a prompt that stopped at its first token
    assert ended[-1] == ("speedup 1.15x (median of 2 interleaved rounds, one prompt each, min 1.10x, max 1.20x; "
                         "2 of 2 faster; 1 prompt(s) ended at their first token (prefill only) and are left out); "
                         "outputs identical to plain decoding: yes")
    idle = summary(rounds, {"num_drafts": 0, "per_position": [None] * 3})
    assert idle[-1].startswith("no drafts: the draft-length policy chose plain decoding at every step")
    assert "speedup 1" not in "\n".join(idle) and "no speedup to report" in idle[-1]
    crowded = summary(rounds, {"num_drafts": 0, "per_position": [None] * 3}, adaptive=False)  # drafts every step
    assert crowded[-1].startswith("no drafts: no decode step had room for a draft before the token limit")
    # DSpark's confidence budget (the demo's default on a CPU) is named when it verified fewer drafts or none
    budgeted = summary(rounds, drafted, adaptive=False, budget=True)[0]
    assert ("4 of 192 decode steps drafted (for the others, DSpark's confidence budget verified none of the drafts "
            "(--no-adaptive-verification verifies every draft))") in budgeted
    unverified = summary(rounds, {"num_drafts": 0, "per_position": [None] * 3}, adaptive=False, budget=True)
    assert unverified[-1].startswith("no drafts: DSpark's confidence budget verified none of the drafts at any step")


def test_demo_refuses_no_prompts(capsys):
    assert main(["demo", "--num-prompts", "0"]) == 2
    assert "--num-prompts must be an integer >= 1, got 0" in capsys.readouterr().err


@needs_pair
def test_demo_says_dflash_has_no_confidence_budget(capsys):
    """Asked for with DFlash, adaptive verification is refused by name, not dropped."""
    assert main(["demo", "--method", "dflash", "--adaptive-verification", "--num-prompts", "1", "--max-tokens", "4",
                 "--device", "cpu"]) == 2
    assert "adaptive_verification need a DSpark drafter with a confidence head" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "chat", "demo", "train", "serve", "bench"])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0 and "usage: blockspec" in capsys.readouterr().out


def test_generate_with_tensor_parallel_size_two(tmp_path, capsys):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    args = ["generate", "--model", str(path), "--prompt", "def f(x):", "--max-tokens", "8", "--device", "cpu"]
    assert main(args) == 0
    single = capsys.readouterr().out
    assert main(args + ["--tensor-parallel-size", "2"]) == 0
    assert capsys.readouterr().out == single


@pytest.mark.parametrize("flags, expected", [(["--async-scheduling", "auto"], False), (["--async-scheduling", "on"], True),
                                            (["--async-scheduling", "off"], False), (["--async-scheduling"], True),
                                            (["--no-async-scheduling"], False)])
def test_async_scheduling_flag_reaches_the_engine(tmp_path, flags, expected):
    """--async-scheduling auto | on | off sets the engine's pipelining (auto: off on the CPU); vLLM's forms, the flag
    alone and --no-async-scheduling, too."""
    import argparse

    from blockspec.cli_options import add_model_args, add_sampling_args, build_llm

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_sampling_args(parser)
    path = save_tiny(tmp_path / "t", "qwen3", seed=0)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", *flags])
    assert build_llm(args).engine.async_scheduling is expected


def test_token_counts_in_vllms_human_readable_form(capsys):
    """--max-model-len 32k and 8K as vLLM reads them (k = 1000, K = 1024); a count that is neither is one
    line naming the flag."""
    import argparse

    from blockspec.cli_options import add_model_args

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    args = parser.parse_args(["--max-model-len", "25.6k", "--max-num-batched-tokens", "8K"])
    assert (args.max_model_len, args.max_prefill_tokens) == (25600, 8192)
    assert parser.parse_args(["--max-model-len", "4096"]).max_model_len == 4096
    assert parser.parse_args(["--max-model-len", "auto"]).max_model_len == -1  # vLLM's: the model's whole length
    for bad, says in (("1.5K", "binary suffixes take whole numbers"), ("4kb", "must be an integer, or one with a suffix")):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-model-len", bad])
        assert f"argument --max-model-len: {says}" in capsys.readouterr().err


def test_an_install_without_the_pair_builds_a_quick_one_whole_or_not_at_all(tmp_path, monkeypatch):
    """Without the embedded pair the demo builds a quick pair into a directory of its own, renamed into the cache
    whole: a build stopped half-way leaves nothing the next run takes for a pair (it took a lone target's
    config.json for one, and failed every later run); an unwritable cache is one line naming it."""
    import blockspec.demo as demo
    import blockspec.train.recipes.embedded_default as recipe
    from blockspec.config import ConfigError

    monkeypatch.setattr(demo, "PAIR", tmp_path / "none")
    monkeypatch.setattr(demo, "CACHE", tmp_path / "cache" / "default-quick")

    def half_build(out, *args):
        (out / "target").mkdir(parents=True)
        (out / "target" / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "run", half_build)
    with pytest.raises(KeyboardInterrupt):
        demo.default_pair()
    assert not demo.CACHE.exists() and not list((tmp_path / "cache").iterdir())

    def whole_build(out, *args):
        for part in ("target", "dflash", "dspark"):
            (out / part).mkdir(parents=True)
            (out / part / "config.json").write_text("{}")
        (out / "target.tar").write_bytes(b"x")
        (out / "metrics.json").write_text("{}")

    monkeypatch.setattr(recipe, "run", whole_build)
    assert demo.default_pair() == (demo.CACHE, False)
    assert (demo.CACHE / "dspark" / "config.json").is_file() and not (demo.CACHE / "target.tar").exists()
    monkeypatch.setattr(recipe, "run", half_build)
    assert demo.default_pair() == (demo.CACHE, False)  # built once: reused
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(demo, "CACHE", tmp_path / "file" / "default-quick")
    with pytest.raises(ConfigError, match=r"cannot write the quick pair's cache .*file: .* \(set BLOCKSPEC_CACHE"):
        demo.default_pair()


def test_prompts_file_text_lines_and_jsonl(tmp_path):
    """A text file's lines are prompts as written, braces and all; a .jsonl file's lines are objects, and a
    line that is not one is named by file and line."""
    from blockspec.inputs import read_prompts_file

    text = tmp_path / "p.txt"
    text.write_text('{k: v for k, v in items}\n\ndef f():\n')
    assert read_prompts_file(str(text), "--prompts-file") == ["{k: v for k, v in items}", "def f():"]
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a"}\n\n{"prompt_token_ids": [1, 2]}\n')
    assert read_prompts_file(str(lines), "--prompts-file") == ["a", {"prompt_token_ids": [1, 2]}]
    for bad, says in (('{"text": "a"}', "give 'prompt'"), ("{k: v}", "not valid JSON"), ('"a"', "give 'prompt'")):
        lines.write_text('{"prompt": "a"}\n' + bad + "\n")
        with pytest.raises(ConfigError, match=rf"^--prompts-file {lines}:2: {says}"):
            read_prompts_file(str(lines), "--prompts-file")
        assert main(["bench", "--model", "default", "--device", "cpu", "--prompts", str(lines)]) == 2  # its reader
    with pytest.raises(ConfigError, match="--prompts-file .*missing"):
        read_prompts_file(str(tmp_path / "missing"), "--prompts-file")


def test_ctrl_c_ends_a_command_with_one_line_and_130(monkeypatch, capsys):
    import blockspec.cli as cli

    def interrupted(args, chat=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_generate", interrupted)
    assert cli.main(["generate", "default", "--prompt", "x"]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_output_the_terminal_cannot_encode_is_escaped_not_a_traceback(monkeypatch):
    """Under an ASCII (or Windows code-page) stdout a model's non-ASCII text prints escaped; it used to end the
    command with a UnicodeEncodeError after all the work was done."""
    import blockspec.cli as cli

    def generate(args, chat=False):
        print("def f(): return '\u672c'")
        return 0

    monkeypatch.setattr(cli, "cmd_generate", generate)
    out = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(out, encoding="ascii"))
    assert cli.main(["generate", "default", "--prompt", "x"]) == 0
    sys.stdout.flush()
    assert out.getvalue() == b"def f(): return '\\u672c'\n"


def test_chat_text_that_was_not_utf8_is_named_as_such(tmp_path, capsys):
    """A chat turn holding bytes that are not UTF-8 (read from a Latin-1 terminal, Python's lone surrogates) is
    one line naming the byte, not a tokenizer's TypeError from inside the chat template."""
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    assert main(["chat", str(path), "--prompt", "caf\udce9", "--device", "cpu", "--max-tokens", "2"]) == 2
    assert ("error: conversation 0, message 0: not valid Unicode: a lone surrogate '\\udce9' at character 3 (what "
            "Python reads for byte 0xe9 of input that is not UTF-8)") in capsys.readouterr().err


def test_ctrl_c_while_torch_loads_is_one_line_and_130():
    """Ctrl-C in the seconds torch takes to import (the start of every command) ends as an interrupt later does:
    importing the command line loads no torch, and `main` imports the engine inside its interrupt handling. The
    interrupt comes as torch is looked up, as a signal there would."""
    import subprocess

    script = ("import sys\n"
              "class Interrupt:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch':\n"
              "            raise KeyboardInterrupt\n"
              "sys.meta_path.insert(0, Interrupt())\n"
              "from blockspec.cli import main\n"
              "sys.exit(main(['generate', 'default', '--prompt', 'x']))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stderr) == (130, "interrupted\n")


def test_model_files_are_read_as_utf8_under_an_ascii_locale(tmp_path):
    """config.json and a chat template file are UTF-8 whatever the locale says: under LC_ALL=C without Python's
    UTF-8 mode (ASCII, as a Windows code page is not UTF-8 either) a non-ASCII character in either was a
    UnicodeDecodeError traceback."""
    import json
    import os
    import subprocess

    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "_name_or_path": "/home/j\u00f6hn/\u65e5\u672c"},
                                                 ensure_ascii=False), encoding="utf-8")
    template = tmp_path / "t.jinja"
    template.write_text("{{ '# caf\u00e9' }}{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    run = subprocess.run([sys.executable, "-m", "blockspec", "chat", str(path), "--prompt", "x", "--chat-template",
                          str(template), "--device", "cpu", "--max-tokens", "2"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "--- 0 [length]" in run.stdout
