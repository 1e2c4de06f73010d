"""The command line: generate with and without a drafter, errors as one line, help texts."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockspec.cli import main
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


def test_bad_model_path_is_one_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not exist" in err and "Traceback" not in err


def test_invalid_sampling_flag_is_one_line(tmp_path, capsys):
    path = save_tiny_model_with_tokenizer(tmp_path / "m")
    assert main(["generate", "--model", str(path), "--prompt", "x", "--top-p", "1.5", "--device", "cpu"]) == 2
    assert "top_p" in capsys.readouterr().err


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


@pytest.mark.parametrize("flag, expected", [("auto", False), ("on", True), ("off", False)])
def test_async_scheduling_flag_reaches_the_engine(tmp_path, flag, expected):
    """--async-scheduling auto | on | off sets the engine's pipelining (auto: off on the CPU)."""
    import argparse

    from blockspec.cli import add_model_args, add_sampling_args, build_llm

    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_sampling_args(parser)
    path = save_tiny(tmp_path / "t", "qwen3", seed=0)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--async-scheduling", flag])
    assert build_llm(args).engine.async_scheduling is expected
