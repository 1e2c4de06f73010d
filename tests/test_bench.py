"""The benchmark harness on the tiny arch (CPU): every method, batch and temperature runs and reports; speculation
and transformers agree with plain decoding token for token; synthetic acceptance is labelled and hits its profile."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from PIL import Image

from blockspec.bench import BenchConfig, markdown, run_bench, write_outputs
from blockspec.bench.arch import TINY, TINY_DFLASH, random_drafter, random_target
from blockspec.bench.harness import source_digest
from blockspec.bench.report import decode_ratio_at_expectation, summary_line
from blockspec.bench.points import point_name
from blockspec.cli import main
from blockspec.config import ConfigError, EngineConfig, SpeculativeConfig
from blockspec.engine.engine import Engine
from blockspec.models import cpu_linear
from blockspec.sampling_params import SamplingParams
from blockspec.models.runner import ModelRunner
from blockspec.speculative.context import DraftContext
from blockspec.speculative.policy import batch_bucket
from blockspec.speculative.proposer import draft_length
from blockspec.sample.rng import STREAM_SYNTHETIC, row_key
from blockspec.speculative.synthetic import AcceptanceProfile, SyntheticProposer, geometric_rate, mean_length
from factories import save_drafter_target, save_moe_target, save_tiny, save_tiny_model_with_tokenizer

# Random drafters are never accepted, so the engine's draft-length policy would rightly stop drafting; these
# tests hold the draft length at the drafter's block to exercise the speculative path.
FULL_DRAFTS = {"adaptive_draft_length": False} if "adaptive_draft_length" in {
    f.name for f in dataclasses.fields(SpeculativeConfig)} else {}
TINY_RUN = dict(random_weights=True, arch="tiny", input_len=(8,), repeats=1, device="cpu",
                speculative_config=FULL_DRAFTS)



@pytest.fixture(scope="module")
def result():
    cfg = BenchConfig(**TINY_RUN, batch_sizes=(1, 2), temperatures=(0.0, 0.7), output_len=16,
                      peers=("transformers",))
    return run_bench(cfg)


def test_every_method_batch_and_temperature_reports(result):
    runs = {(r["method"], r["batch"], r["temperature"]): r for r in result["runs"]}
    for method in ("plain", "dflash", "dspark"):
        for b in (1, 2):
            for t in (0.0, 0.7):
                r = runs[(method, b, t)]
                assert r["status"] == "ok" and not r["synthetic"]
                assert r["num_requests"] == b and r["output_tok_s"]["median"] > 0
                assert r["tpot_ms"]["p50"] > 0 and r["ttft_ms"]["p90"] >= r["ttft_ms"]["p50"]
                assert r["memory_gb_total"] == pytest.approx(sum(r["memory_gb"].values()))  # CPU: no pass peak
                # every request is admitted and prefilled in a pass's first step, which the decode figures leave out
                pre = r["prefill_steps"]
                assert pre["steps"] == 1 and pre["ms_median"] > 0 and 0 < pre["share"] < 1
                # the drafter's held taps: a verify's rows and a plain step's per slot, target taps wide
                parts = r["memory_gb"]
                assert ("draft_pending" in parts) == (method != "plain") and not any(p.startswith("graphs") for p in parts)
                if method != "plain":
                    acc = r["acceptance"]
                    assert acc["mean_acceptance_length"] >= 1 and len(acc["per_position"]) == acc[
                        "num_speculative_tokens"]
                    assert r["vs_plain"]["output_tok_s_ratio"] > 0
                    # exact speculation: same tokens as plain (T > 0 too: sample-and-match, same seeds)
                    assert r["prefix_match_plain"] == 1.0
    # the LM heads' packed copies on the CPU: the target's (float32) in every run, a drafter's (bfloat16) beside it
    copies = {m: runs[(m, 1, 0.0)]["memory_gb"].get("head_copies", 0.0) for m in ("plain", "dflash", "dspark")}
    assert (copies["plain"] > 0) == cpu_linear.onednn_available()
    assert all((copies[m] > copies["plain"]) == cpu_linear.bf16_products() for m in ("dflash", "dspark"))
    assert not result["synthetic"] and result["synthetic_acceptance"] is None
    assert result["device_type"] == "cpu" and result["torch"] == torch.__version__ and result["command"]
    assert set(result["checks"]["vs_plain"]) == {"dflash", "dspark"}


def test_transformers_generate_gives_blockspec_greedy_tokens(result):
    peers = [r for r in result["runs"] if r["method"].startswith("hf-")]
    generate = [r for r in peers if r["method"] == "hf-generate"]
    assert {r["batch"] for r in generate} == {1, 2}
    for r in generate:
        assert r["status"] == "ok" and r["prefix_match_plain"] == 1.0  # the real cross-check
    assisted = [r for r in peers if r["method"] == "hf-assisted"]
    assert assisted and all(r["status"] == "n/a" and "real draft model" in r["reason"] for r in assisted)


def test_outputs_written(result, tmp_path):
    paths = write_outputs(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["runs"] == json.loads(json.dumps(result["runs"]))
    md = paths["markdown"].read_text()
    assert "| method | batch | T | input | output tok/s" in md and "Per-position acceptance" in md
    assert "SYNTHETIC" not in md
    run = next(r for r in result["runs"] if r["method"] == "dspark" and r["batch"] == 2 and r["temperature"] == 0)
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3g}" for k, v in run["memory_gb"].items())
    assert f"- dspark {point_name(run)}: {parts}" in md.split("What a speculative run holds, by part")[1]
    assert "draft pending" in parts and "drafter weights" in parts
    pre = run["prefill_steps"]
    assert (f"- dspark {point_name(run)}: 1 x {pre['ms_median']:.2f} ms, {pre['share']:.0%}"
            in md.split("Steps that admit or prefill")[1])
    for key in ("plot_speedup", "plot_throughput", "plot_acceptance"):
        with Image.open(paths[key]) as img:
            assert img.format == "PNG" and "SYNTHETIC" not in img.info["Title"]
            assert "float32) on cpu" in img.info["Title"] and "8-token prompts, 16 output tokens, real acceptance" in \
                img.info["Title"]
    assert "issue" not in md.lower()
    assert f"source digest {source_digest()}" in md  # the package that ran, whatever git says


def test_the_source_digest_follows_python_sources_only(tmp_path):
    """The digest a report carries names the code: a changed byte or a renamed module changes it, other
    files do not."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    assert len(first) == 12 and source_digest(tmp_path) == first
    (tmp_path / "notes.md").write_text("not code")
    assert source_digest(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 3\n")
    changed = source_digest(tmp_path)
    assert changed != first
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert source_digest(tmp_path) not in (first, changed)


def test_plots_group_colours_by_method_read_plainly_and_mark_what_never_drafted(result):
    """One colour per method and one line style per temperature; batch ticks are plain numbers; a position
    never drafted is an x marked "never drafted" (not a 0 on the line); a run that never drafted is
    marked "no drafts" on the speedup plot, not given a speedup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from blockspec.bench.plots import acceptance_figure, speedup_figure, throughput_figure

    fig, heading = throughput_figure(result)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2"]
    assert all("^" not in t.get_text() for t in ax.get_yticklabels())
    colour = {}
    for container in ax.containers:
        method, temp = container.get_label().rsplit(", T=", 1)
        line = container.lines[0]
        assert colour.setdefault(method, line.get_color()) == line.get_color()
        assert line.get_linestyle() == ("-" if float(temp) == 0 else "--")
    assert len(set(colour.values())) == len(colour) == 4  # plain, dflash, dspark, hf-generate
    assert heading.startswith(result["model"]["target"])
    plt.close(fig)

    edited = json.loads(json.dumps(result))
    dflash = next(r for r in edited["runs"] if r["method"] == "dflash")
    dflash["acceptance"]["per_position"][2:] = [None] * (len(dflash["acceptance"]["per_position"]) - 2)
    fig, _ = acceptance_figure(edited)
    ax = fig.axes[0]
    k = len(dflash["acceptance"]["per_position"])
    marks = [line for line in ax.lines if line.get_marker() == "x" and len(line.get_xdata())]
    assert [list(line.get_xdata()) for line in marks] == [list(range(3, k + 1))]  # only the edited run's
    assert list(marks[0].get_ydata()) == [0.0] * (k - 2) and marks[0].get_color() == "tab:blue"
    line = next(line for line in ax.lines if line.get_marker() != "x" and math.isnan(line.get_ydata()[-1]))
    assert not any(math.isnan(y) for y in line.get_ydata()[:2]) and all(math.isnan(y) for y in line.get_ydata()[2:])
    assert "never drafted" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)

    dflash["acceptance"]["num_drafts"] = 0
    fig, _ = speedup_figure(edited)
    assert [t.get_text() for t in fig.axes[0].texts] == ["no drafts:\ndflash, T=0.0"]
    series = {c.get_label(): list(c.lines[0].get_xdata()) for c in fig.axes[0].containers}
    assert series["dflash, T=0.0"] == [2] and series["dspark, T=0.0"] == [1, 2]  # no speedup drawn at batch 1
    plt.close(fig)


def test_assisted_generation_with_a_draft_model(tmp_path):
    assistant = save_tiny(tmp_path / "assistant", "qwen3", seed=3, vocab=TINY.vocab_size, hidden=32, layers=2,
                          heads=2, kv_heads=1, head_dim=16)
    cfg = BenchConfig(**TINY_RUN, methods=("plain",), batch_sizes=(1, 2), output_len=12, peers=("transformers",),
                      peer_assistant=str(assistant))
    runs = {(r["method"], r["batch"]): r for r in run_bench(cfg)["runs"]}
    assert runs[("hf-assisted", 1)]["status"] == "ok"
    assert runs[("hf-assisted", 1)]["prefix_match_plain"] == 1.0  # assisted greedy is exact too
    assert runs[("hf-assisted", 2)]["status"] == "n/a" and "batch size 1" in runs[("hf-assisted", 2)]["reason"]


# ------------------------------------------------------------------------------------------- synthetic
def test_profile_parsing():
    assert AcceptanceProfile("0.9,0.5").rates(4) == [0.9, 0.5, 0.0, 0.0]
    assert AcceptanceProfile("0.9,0.8,0.7").rates(2) == [0.9, 0.8]
    assert AcceptanceProfile("0.5").expected_length(3) == pytest.approx(1.5)
    p = geometric_rate(6.5, 15)
    assert 1 + sum(p**i for i in range(1, 16)) == pytest.approx(6.5)
    assert AcceptanceProfile("6.5").expected_length(15) == pytest.approx(6.5)
    for bad in ("1.5,0.3", "abc", "", "20"):
        with pytest.raises(ConfigError):
            AcceptanceProfile(bad).rates(15)


def _proposer_parts():
    target = random_target(TINY, 256, "cpu", torch.float32)
    drafter = random_drafter(TINY_DFLASH, "cpu", torch.float32)
    return target, drafter, SpeculativeConfig(method="dflash", model="random")


def test_draws_follow_the_profile():
    target, drafter, spec = _proposer_parts()
    profile = AcceptanceProfile("0.9,0.8,0.7,0.6,0.5,0.4,0.3")
    context = DraftContext(drafter, 2, 128, draft_length(spec, drafter), 2, torch.float32, torch.device("cpu"))
    prop = SyntheticProposer(drafter, target, ModelRunner(target, 2, 128), spec, context, profile=profile, seed=1)
    keys = row_key(torch.full((20000,), 5), torch.arange(20000), STREAM_SYNTHETIC, None)  # distinct rows
    draws = prop.draw(torch.full((20000,), 7), keys).tolist()
    assert 1 + sum(draws) / len(draws) == pytest.approx(profile.expected_length(7), abs=0.05)
    for i, rate in enumerate(profile.rates(7)):  # conditional acceptance per position
        reached = sum(a >= i for a in draws)
        assert sum(a > i for a in draws) / reached == pytest.approx(rate, abs=0.03)
    capped = prop.draw(torch.tensor([2, 0, 5] * 1000), keys[:3000]).view(-1, 3)
    assert capped[:, 0].max() == 2 and capped[:, 1].max() == 0  # never past each request's draft budget
    assert capped[:, 2].max() == 5


def test_draws_are_keyed_by_request_and_position_not_by_engine():
    """Engines that verify a request from the same position draw the same count, whatever else their
    batch holds and however many draws came before; another position, request or seed draws afresh."""
    from blockspec.engine.engine import Engine

    target, drafter, _ = _proposer_parts()
    spec = SpeculativeConfig(method="dflash", model="random", adaptive_draft_length=False)
    profile = AcceptanceProfile("4.0")

    def counts(prompts: list[list[int]], seed: int = 1) -> list[tuple]:
        """Each request's drafts, accepted drafts and accepted drafts per position."""
        engine = Engine(target, None, EngineConfig(max_model_len=128, max_num_seqs=len(prompts)), spec, drafter,
                        proposer_cls=functools.partial(SyntheticProposer, profile=profile, seed=seed))
        reqs = [engine.add_request(f"r{i}", None, p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                                    seed=100 + i))[0] for i, p in enumerate(prompts)]
        while engine.has_unfinished():
            engine.step()
        return [(r.spec.num_drafts, r.spec.num_accepted_tokens,
                 tuple(r.spec.num_accepted_tokens_per_pos)) for r in reqs]

    a, b = [1, 2, 3, 4, 5], [9, 8, 7]
    alone, together = counts([a]), counts([a, b])
    assert alone[0] == together[0]  # request a's draws do not depend on b sharing its steps
    assert counts([a], seed=2)[0] != alone[0]  # negative control: another seed draws otherwise


def test_a_pass_counts_the_drafts_of_steps_that_also_admit_requests():
    """Requests in waves (6 requests, 2 slots): steps that admit a request also verify the running ones'
    drafts; the pass's acceptance counts them, so it equals the requests' own counters."""
    from blockspec.bench.drafts import StepLog
    from blockspec.bench.harness import drive
    from blockspec.engine.engine import Engine

    target, drafter, _ = _proposer_parts()
    spec = SpeculativeConfig(method="dflash", model="random", adaptive_draft_length=False)
    engine = Engine(target, None, EngineConfig(max_model_len=128, max_num_seqs=2), spec, drafter,
                    proposer_cls=functools.partial(SyntheticProposer, profile=AcceptanceProfile("4.0"), seed=1))
    engine.spec_totals = StepLog()
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(6)]
    got = drive(engine, prompts, params)
    assert len(got.prefill_s) >= 3  # admissions while others decode
    totals = engine.spec_totals
    assert totals.num_drafts > 0 and len(got.drafts) == totals.num_drafts
    assert sum(n for n, _ in got.drafts) == totals.num_draft_tokens
    assert sum(a for _, a in got.drafts) == totals.num_accepted_tokens


def test_a_mean_length_profile_is_the_whole_blocks_and_fewer_drafts_truncate_it():
    """"3.5" is the mean acceptance length of the drafter's whole block (7 drafts here); verifying only 3
    keeps the first 3 of the same rates, so the shorter draft length accepts less, as the same drafter
    would, instead of a higher rate solved for 3 drafts."""
    target, drafter, _ = _proposer_parts()
    spec = SpeculativeConfig(method="dflash", model="random", num_speculative_tokens=3)
    context = DraftContext(drafter, 2, 128, draft_length(spec, drafter), 2, torch.float32, torch.device("cpu"))
    prop = SyntheticProposer(drafter, target, ModelRunner(target, 2, 128), spec, context,
                             profile=AcceptanceProfile("3.5"), seed=1)
    assert drafter.num_draft_slots == 7 and prop.num_speculative_tokens == 3
    assert prop.rates == pytest.approx([geometric_rate(3.5, 7)] * 3)
    assert prop.expected_length(3) == pytest.approx(mean_length(AcceptanceProfile("3.5").rates(7)[:3]))
    assert prop.expected_length(3) < AcceptanceProfile("3.5").expected_length(7) == pytest.approx(3.5)


def test_synthetic_proposer_refuses_without_a_profile():
    target, drafter, spec = _proposer_parts()
    with pytest.raises(ConfigError, match="explicit acceptance profile"):
        Engine(target, None, EngineConfig(max_model_len=64, max_num_seqs=1), spec, drafter,
               proposer_cls=SyntheticProposer)
    with pytest.raises(ConfigError, match="speculative methods"):
        run_bench(BenchConfig(**TINY_RUN, methods=("plain",), synthetic_acceptance="4"))


def test_synthetic_run_is_labelled_and_hits_the_profile(tmp_path):
    cfg = BenchConfig(**TINY_RUN, methods=("plain", "dflash", "dspark"), batch_sizes=(8,), output_len=120,
                      synthetic_acceptance="4.5", synthetic_seed=3)
    res = run_bench(cfg)
    assert res["synthetic"] and res["synthetic_acceptance"]["profile"] == "4.5"
    for r in res["runs"]:
        assert r["synthetic"] == (r["method"] != "plain")
        if r["synthetic"]:
            acc = r["acceptance"]
            assert acc["expected_length"] == pytest.approx(4.5, abs=0.1)  # a few budget-cut final steps
            assert acc["num_drafts"] > 150
            assert acc["mean_acceptance_length"] == pytest.approx(acc["expected_length"], abs=0.45)
            assert "prefix_match_plain" not in r  # synthetic tokens are not compared with the target's
    paths = write_outputs(res, tmp_path)
    md = paths["markdown"].read_text()
    assert md.startswith("# ") and "SYNTHETIC ACCEPTANCE" in md.splitlines()[0]
    for r in res["runs"][1:]:  # the draws' luck taken out: measured decode ratio x expected / drawn
        acc, ratio = r["acceptance"], r["vs_plain"]["decode_tok_s_ratio"]
        at_expectation = decode_ratio_at_expectation(r)
        assert at_expectation == pytest.approx(ratio * acc["expected_length"] / acc["mean_acceptance_length"])
        assert (f"- {r['method']} {point_name(r)}: {acc['mean_acceptance_length']:.2f} / "
                f"{acc['expected_length']:.2f}; decode {at_expectation:.2f}x") in md
    assert decode_ratio_at_expectation(res["runs"][0]) is None  # plain has no draws
    assert "dflash (synthetic)" in md
    assert json.loads(paths["json"].read_text())["synthetic"] is True
    for key in ("plot_throughput", "plot_acceptance"):
        with Image.open(paths[key]) as img:
            assert img.info["Title"].startswith("SYNTHETIC ACCEPTANCE")


# ------------------------------------------------------------------------------------------- CLI
def test_cli_help(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--synthetic-acceptance" in out and "--random-weights" in out and "--peers" in out
    assert "seed of the random prompts, weights and sampling (default:" in " ".join(out.split())
    assert "(default: (" not in out and "(default: True)" not in out


def test_cli_runs_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--methods", "plain,dflash",
            "--input-len", "8", "--output-len", "8", "--repeats", "1", "--out", str(out)]
    assert main(args) == 0
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md", "tok_s_vs_batch.png"}
    assert "| dflash | 1 | 0.0 |" in capsys.readouterr().out
    assert main(args + ["--synthetic-acceptance", "0.9,1.7"]) == 2
    assert "rates must be in [0, 1]" in capsys.readouterr().err
    assert main(["bench", "--arch", "tiny"]) == 2  # neither --random-weights nor --model
    assert main(["bench", "--random-weights", "--arch", "tiny", "--prompts", "builtin"]) == 2


RANDOM = dict(random_weights=True, arch="tiny", methods=("plain", "dflash"))


@pytest.mark.parametrize("given, says", [
    (dict(batch_sizes=(1, 1)), "--batch-sizes names 1 more than once"),
    (dict(temperatures=(0.0, 0.7, 0.0)), "--temperatures names 0.0 more than once"),
    (dict(temperatures=(float("nan"),)), r"--temperatures must be numbers >= 0, got \(nan,\)"),
    (dict(peer_temperatures=(-1.0,), peers=("transformers",)), "--peer-temperatures must be numbers >= 0"),
    (dict(waves=0), "--waves must be >= 1, got 0"),
    (dict(repeats=0), "--repeats must be >= 1, got 0"),
    (dict(peers=("transformers",), peer_batch_sizes=(0,)), r"--peer-batch-sizes must be integers >= 1, got \(0,\)"),
    (dict(peers=("transformers",), peer_output_len=0), "--peer-output-len must be >= 1, got 0"),
    (dict(peer_assistant="/a", peer_output_len=4), "--peer-assistant, --peer-output-len set.* give --peers too"),
    (dict(random_weights=False, model="m", methods=("plain",), dspark_block_size=3),
     "--dspark-block-size shapes the random DSpark drafter"),
    (dict(random_weights=False, model="m", methods=("plain",), prompts="builtin", input_len=(64,)),
     "--input-len sets the length of random-token prompts"),
])
def test_workload_options_that_cannot_apply_are_refused_by_flag(given, says):
    """Each error names its flag: a repeated point (whose plain baseline would be another run's), a peer
    option without --peers, or an option that changes nothing where it is given."""
    with pytest.raises(ConfigError, match=says):
        BenchConfig(**{**RANDOM, **given}).validate()


def test_random_weights_refuse_prompts_past_the_arch_positions(tmp_path, capsys):
    """--input-len beyond the random target's max_position_embeddings (4096 for tiny) is refused, as for a
    checkpoint, not run past the positions the shape was made for."""
    assert main(["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--methods", "plain",
                 "--input-len", "5000", "--output-len", "4", "--no-plots", "--out", str(tmp_path / "b")]) == 2
    assert "need 5004 positions; --arch tiny has 4096 (max_position_embeddings)" in capsys.readouterr().err


def test_peers_run_the_batch_they_report_and_drafters_keep_their_description(tmp_path):
    """A peer batch larger than the engines' gets its own prompts (it ran one and reported three), and the
    report names each drafter (its step terms live apart, under drafter_terms)."""
    cfg = BenchConfig(**TINY_RUN, methods=("plain", "dflash"), batch_sizes=(1,), output_len=6, peers=("transformers",),
                      peer_batch_sizes=(3,), synthetic_acceptance="2")
    result = run_bench(cfg)
    peer = next(r for r in result["runs"] if r["method"] == "hf-generate")
    assert peer["batch"] == 3 and peer["num_requests"] == 3
    assert result["model"]["drafters"]["dflash"].startswith("random weights, tiny shape: block")
    assert "weight_bytes_gb" in result["model"]["drafter_terms"]["dflash"]
    assert "- dflash: random weights, tiny shape: block" in markdown(result)


def test_the_commit_recorded_is_blockspecs_own_checkouts(tmp_path):
    """A bench run records the commit of the checkout blockspec runs from; installed inside some project's
    repository (its ignored .venv), it recorded that project's commit as blockspec's."""
    import subprocess

    from blockspec.bench.harness import source_commit

    assert source_commit() is not None  # this checkout
    project = tmp_path / "project"
    installed = project / ".venv" / "site-packages" / "blockspec"
    installed.mkdir(parents=True)
    for args in (["init", "-q"], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty",
                                  "-m", "my app"]):
        subprocess.run(["git", *args], cwd=project, check=True)
    assert source_commit(installed) is None


def test_markdown_marks_slower_points(result):
    slow = json.loads(json.dumps(result))
    for r in slow["runs"]:
        if r["method"] == "dflash":
            r["vs_plain"]["output_tok_s_ratio"], r["vs_plain"]["output_tok_s_ratio_range"] = 0.5, [0.45, 0.55]
    assert "**0.50x [0.45-0.55] (slower)**" in markdown(slow)


def test_methods_are_timed_in_interleaved_rounds(monkeypatch):
    """Every method's warm-up, then one pass of each per round in an order rotated each round, so a drift of
    the machine's speed falls on all methods alike (timed in blocks, a method's passes all fall in one
    stretch: an embedded-pair run showed 1.43x and 1.81x for drafters that never drafted)."""
    from blockspec.bench import harness

    order = []

    def fake_drive(engine, prompts, params):
        order.append(engine.name)
        return harness.Pass(1.0, 10, 1.0, 9, {0: [0.1]}, {0: [1]}, [], [0.01], [0.1], [[1] * 10])

    monkeypatch.setattr(harness, "drive", fake_drive)
    monkeypatch.setattr(harness, "summarize", lambda engine, passes, *rest: {"passes": len(passes)})

    class FakeEngine:
        def __init__(self, name):
            self.name, self.device = name, torch.device("cpu")
            self.timer = dataclasses.make_dataclass("T", [("totals", dict)])({})

    engines = {m: FakeEngine(m) for m in ("plain", "dflash", "dspark")}
    out = harness.measure_point(engines, [[1]], [SamplingParams()], 3, dict.fromkeys(engines, 0))
    assert order == ["plain", "dflash", "dspark",  # warm-up
                     "plain", "dflash", "dspark", "dflash", "dspark", "plain", "dspark", "plain", "dflash"]
    assert {m: run["passes"] for m, (run, _) in out.items()} == {"plain": 3, "dflash": 3, "dspark": 3}


def test_timed_passes_run_with_every_engine_out_of_the_collectors_walks(monkeypatch):
    """The timed rounds run with what is alive frozen (a pass beside more engines would otherwise pay for their
    objects in its full collections), the warm-up passes not, and the freeze ends with the point."""
    import gc

    from blockspec.bench import harness, timing

    frozen = []

    def fake_drive(engine, prompts, params):
        frozen.append(gc.get_freeze_count())
        return harness.Pass(1.0, 10, 1.0, 9, {0: [0.1]}, {0: [1]}, [], [0.01], [0.1], [[1] * 10])

    monkeypatch.setattr(harness, "drive", fake_drive)
    monkeypatch.setattr(harness, "summarize", lambda engine, passes, *rest: {})

    class FakeEngine:
        device = torch.device("cpu")
        timer = dataclasses.make_dataclass("T", [("totals", dict)])({})

    before = gc.get_freeze_count()
    engines = {m: FakeEngine() for m in ("plain", "dflash")}
    harness.measure_point(engines, [[1]], [SamplingParams()], 2, dict.fromkeys(engines, 0))
    assert frozen[:2] == [before, before] and all(n > before for n in frozen[2:]) and len(frozen) == 6
    assert gc.get_freeze_count() == before
    frozen.clear()
    monkeypatch.setattr(timing, "FREEZE_COLLECTOR", False)  # the switch an A/B of the bench itself uses
    harness.measure_point(engines, [[1]], [SamplingParams()], 1, dict.fromkeys(engines, 0))
    assert frozen == [before] * 4


def test_speedup_is_the_median_of_the_rounds_ratios_with_their_range():
    """Each round's speculative pass over the same round's plain pass: rounds of 100 / 50 plain tok/s and
    110 / 60 speculative give 1.1 and 1.2 (median 1.15), where the medians' ratio would be 85 / 75."""
    from blockspec.bench.report import compare_to_plain, speedup_cell

    def run(method, output):
        return {"method": method, "batch": 1, "temperature": 0.0, "status": "ok", "output_len": 8,
                "output_tok_s": {"median": sum(output) / 2}, "decode_tok_s": {"median": sum(output) / 2},
                "rounds": {"output_tok_s": output, "decode_tok_s": output}, "steps_by_draft_length": {"0": {}},
                "acceptance": {"num_drafts": 5} if method != "plain" else None}

    plain, spec = run("plain", [100.0, 50.0]), run("dflash", [110.0, 60.0])
    spec["rounds"]["decode_tok_s"] = [130.0, 70.0]  # decode rates apart from output rates: 1.3 and 1.4
    compare_to_plain([plain, spec])
    assert spec["vs_plain"]["output_tok_s_ratio"] == pytest.approx(1.15)
    assert spec["vs_plain"]["output_tok_s_ratio_range"] == pytest.approx([1.1, 1.2])
    assert speedup_cell(spec) == "1.15x [1.10-1.20]"
    assert speedup_cell(spec, "decode") == "1.35x [1.30-1.40]"


def test_a_speculative_run_that_never_drafted_says_no_drafts(tmp_path):
    """A drafter with a batch over max_batch_for_speculation runs plain steps only: its row says "no drafts",
    never a speedup, in the log line, the table and the figures against plain."""
    cfg = BenchConfig(**{**TINY_RUN, "speculative_config": {"max_batch_for_speculation": 1}, "repeats": 2},
                      methods=("plain", "dflash"), batch_sizes=(2,), output_len=8)
    res = run_bench(cfg)
    (spec,) = [r for r in res["runs"] if r["method"] == "dflash"]
    assert spec["acceptance"]["num_drafts"] == 0 and spec["prefix_match_plain"] == 1.0
    assert "no drafts" in summary_line(spec)
    md = markdown(res)
    assert "| dflash | 2 | 0.0 |" in md and "| no drafts | 0% |" in md and "no drafts: the draft-length policy" in md
    assert res["checks"]["vs_plain"]["dflash"][0]["verdict"] == "no drafts"
    assert "- dflash: in8 b2 T0.0 no drafts" in md


def test_preset_default_benchmarks_the_embedded_pair_with_real_acceptance(tmp_path, capsys):
    """--preset default: the embedded target and both drafters on held-out stdlib openings as plain text;
    the report says real acceptance, and speculation gives plain decoding's tokens."""
    from blockspec.assets import PAIR

    cfg = BenchConfig(preset="default")
    cfg.apply_preset()
    assert cfg.model == str(PAIR / "target") and cfg.dspark_model == str(PAIR / "dspark")
    assert cfg.prompts == "heldout" and cfg.chat_template is False and cfg.dtype == "float32"
    given = BenchConfig(preset="default", dtype="bfloat16")
    given.apply_preset()
    assert given.dtype == "bfloat16"  # a given --dtype stays
    with pytest.raises(ConfigError, match="names the models itself"):
        BenchConfig(preset="default", model="x").apply_preset()
    named = BenchConfig(model="default", dspark_model="default")  # as every command takes the name
    named.apply_preset()
    assert (named.model, named.dflash_model, named.dspark_model) == (str(PAIR / "target"), None,
                                                                     str(PAIR / "dspark"))
    other = BenchConfig(model="org/name", dflash_model="some/dir")
    other.apply_preset()
    assert (other.model, other.dflash_model) == ("org/name", "some/dir")
    out = tmp_path / "out"
    assert main(["bench", "--preset", "default", "--device", "cpu", "--output-len", "8", "--repeats", "1",
                 "--no-plots", "--out", str(out)]) == 0
    md = (out / "bench.md").read_text()
    assert md.splitlines()[0].endswith("8 output tokens, real acceptance") and "SYNTHETIC" not in md
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert {r["method"] for r in runs} == {"plain", "dflash", "dspark"}
    assert all(r["prefix_match_plain"] == 1.0 for r in runs if r["method"] != "plain")
    # lengths past the positions the model was trained on are refused (they ran, and called it real acceptance)
    assert main(["bench", "--model", "default", "--input-len", "5000", "--output-len", "4", "--device", "cpu",
                 "--no-plots", "--out", str(tmp_path / "long")]) == 2
    assert "need 5004 positions; " in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- workload presets
def test_workload_presets_fill_what_the_user_left_unset():
    """--preset concurrency / long-context: random weights of --arch, the three methods, synthetic acceptance
    6.5 at T = 0 over 3 rounds, and each workload's lengths and concurrencies; an option the user gives wins,
    even one equal to the default without a preset (--output-len 256, --batch-sizes 1)."""
    cfg = BenchConfig(preset="concurrency")
    cfg.apply_preset()
    assert cfg.random_weights and cfg.arch == "qwen3-8b" and cfg.model is None
    assert cfg.selected_methods() == ("plain", "dflash", "dspark") and cfg.synthetic_acceptance == "6.5"
    assert (cfg.input_len, cfg.output_len, cfg.batch_sizes) == ((512,), 1024, (1, 4, 8, 16, 32, 64))
    assert cfg.temperatures == (0.0,) and cfg.repeats >= 3
    assert cfg.waves == 4  # concurrency held with finished slots refilled, as serving benches hold it
    cfg = BenchConfig(preset="long-context")
    assert (cfg.input_len, cfg.output_len, cfg.batch_sizes, cfg.waves) == ((8192, 32768), 256, (1, 16), 1)
    assert cfg.synthetic_acceptance == "6.5" and cfg.temperatures == (0.0,) and cfg.repeats >= 3

    mine = BenchConfig(preset="concurrency", arch="tiny", batch_sizes=(1,), output_len=256, repeats=5,
                       synthetic_acceptance="4.5", temperatures=(0.0, 0.7), waves=1)
    mine.apply_preset()
    assert (mine.arch, mine.batch_sizes, mine.output_len, mine.repeats, mine.waves) == ("tiny", (1,), 256, 5, 1)
    assert mine.synthetic_acceptance == "4.5" and mine.temperatures == (0.0, 0.7) and mine.input_len == (512,)
    plain = BenchConfig(preset="concurrency", methods=("plain",))  # no speculative method: no synthetic profile
    plain.apply_preset()
    plain.validate()
    assert plain.synthetic_acceptance is None
    bare = BenchConfig(random_weights=True)  # without a preset, the defaults as before
    assert (bare.batch_sizes, bare.temperatures, bare.input_len, bare.output_len, bare.repeats, bare.waves) == (
        (1,), (0.0,), (512,), 256, 3, 1)
    assert bare.synthetic_acceptance is None and bare.selected_methods() == ("plain", "dflash", "dspark")
    with pytest.raises(ConfigError, match="unknown; allowed: default, concurrency, long-context"):
        BenchConfig(preset="serving").apply_preset()


@pytest.mark.parametrize("given", [dict(model="m"), dict(dflash_model="d"), dict(prompts="builtin")])
def test_a_workload_preset_refuses_a_conflicting_option_in_one_line(given):
    with pytest.raises(ConfigError) as exc:
        BenchConfig(preset="long-context", **given).apply_preset()
    assert "--preset long-context runs random weights" in str(exc.value) and "\n" not in str(exc.value)


def test_what_a_random_weights_run_cannot_do_is_refused_before_the_weights_are_built(monkeypatch, capsys, tmp_path):
    """A mean acceptance length no drafter's block can reach fails with the options (it used to fail after the
    weights were built), and on the CPU an --arch whose weights do not fit the host's free memory is refused by
    name (it used to be killed by the kernel without a word)."""
    with pytest.raises(ConfigError, match=r"synthetic acceptance length 100.0 must be in \[1, 9\) for 8 drafts"):
        BenchConfig(random_weights=True, arch="tiny", methods=("dspark",), synthetic_acceptance="100").validate()
    BenchConfig(random_weights=True, arch="tiny", methods=("dspark",), synthetic_acceptance="6.5").validate()
    monkeypatch.setattr("blockspec.bench.harness.available_memory", lambda: 2**30)
    assert main(["bench", "--random-weights", "--arch", "qwen3-8b", "--methods", "plain", "--device", "cpu",
                 "--no-plots", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--arch qwen3-8b: its random float32 weights take 30.5 GiB, more than this host's 1.0 GiB" in err
    assert "Traceback" not in err


def test_cli_presets_run_small_on_the_cpu_with_overrides(tmp_path, capsys):
    """The presets as a user runs them on the CPU: --arch tiny and short lengths override the workload,
    the rest (methods, T, synthetic acceptance) is the preset's; long-context's prompt lengths are separate
    points, each reported with its length in the table and the JSON."""
    out = tmp_path / "conc"
    assert main(["bench", "--preset", "concurrency", "--arch", "tiny", "--device", "cpu", "--batch-sizes", "1",
                 "--input-len", "8", "--output-len", "8", "--repeats", "1", "--no-plots", "--out", str(out)]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["synthetic"] and data["config"]["random_weights"] and data["config"]["batch_sizes"] == [1]
    assert set(data["model"]["drafters"]) == {"dflash", "dspark"} and data["model"]["kv_bytes_per_token"] > 0
    assert {(r["method"], r["batch"], r["temperature"]) for r in data["runs"]} == {
        (m, 1, 0.0) for m in ("plain", "dflash", "dspark")}
    out = tmp_path / "long"
    assert main(["bench", "--preset", "long-context", "--arch", "tiny", "--device", "cpu", "--input-len", "8,24",
                 "--batch-sizes", "2", "--output-len", "8", "--repeats", "1", "--methods", "plain,dflash",
                 "--no-plots", "--out", str(out)]) == 0
    runs = json.loads((out / "bench.json").read_text())["runs"]
    assert [(r["method"], r["input_len"], r["prompt_tokens_mean"]) for r in runs] == [
        ("plain", 8, 8), ("dflash", 8, 8), ("plain", 24, 24), ("dflash", 24, 24)]
    assert all(r["vs_plain"]["output_tok_s_ratio"] > 0 for r in runs if r["method"] == "dflash")
    md = (out / "bench.md").read_text()
    assert "8/24-token prompts" in md.splitlines()[0]
    assert "| dflash (synthetic) | 2 | 0.0 | 8 |" in md and "| dflash (synthetic) | 2 | 0.0 | 24 |" in md
    assert "in24 b2 T0.0" in md
    capsys.readouterr()
    assert main(["bench", "--preset", "concurrency", "--model", "x"]) == 2
    err = capsys.readouterr().err
    assert "--preset concurrency runs random weights" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------- fixed-K sweep
def _run(decode_rounds, output=100.0, **fields):
    """A hand-made run record with the fields the K sweep reads."""
    med = sorted(decode_rounds)[len(decode_rounds) // 2]
    return {"method": "dflash", "input_len": 512, "batch": 4, "temperature": 0.0, "synthetic": True,
            "output_tok_s": {"median": output}, "decode_tok_s": {"median": med},
            "rounds": {"decode_tok_s": list(decode_rounds)}, "acceptance": {"mean_draft_length": 5.0},
            "steps_by_draft_length": {"0": {"steps": 1}, "5": {"steps": 3}}, **fields}


def test_k_sweep_verdict_within_and_missing_on_hand_made_numbers():
    """The best fixed K is the one with the highest median decode tok/s (not output tok/s); the policy's
    decode tok/s over it is the median of the rounds' ratios; within 5 % passes, more than that misses."""
    from blockspec.bench.ksweep import sweep_lines, sweep_point, sweep_report, verdict

    fixed = [_run([100.0, 100.0, 100.0], output=80.0, fixed_k=4, acceptance={"mean_acceptance_length": 4.5}),
             _run([90.0, 95.0, 92.0], output=99.0, fixed_k=8)]
    close = sweep_point(_run([96.0, 100.0, 98.0]), fixed)
    assert close["best_acceptance_length"] == 4.5 and close["policy_acceptance_length"] is None
    assert close["best_k"] == 4 and close["best_decode_tok_s"] == 100.0
    assert close["policy_over_best"] == pytest.approx(0.98) and close["policy_over_best_range"] == pytest.approx(
        [0.96, 1.0])
    assert close["within"] and close["verdict"] == "within 5 %"
    assert close["policy_drafting_share"] == 0.75 and [r["fixed_k"] for r in close["fixed"]] == [4, 8]
    far = sweep_point(_run([90.0, 88.0, 92.0]), fixed)
    assert far["policy_over_best"] == pytest.approx(0.90) and not far["within"]
    assert far["verdict"] == "misses by 10.0 %"
    assert verdict(0.951) == "within 5 %" and verdict(0.949) == "misses by 5.1 %" and verdict(1.2) == "within 5 %"

    report = sweep_report((4, 8, 15), {"dflash": 8}, [close, far])
    assert report["methods"] == {"dflash": {"capacity": 8, "k": [4, 8]}} and not report["all_within"]
    assert report["notes"] == ["dflash: its block holds 8 drafts (K in 1-8); K=15 run as K=8"]
    md = "\n".join(sweep_lines(report))
    assert "| dflash (synthetic) | 4 | 0.0 | 512 | 80.0 / 100.0 | 99.0 / 92.0 | 4 | 98.0 | 5.0 (75%) " \
           "| n/a / 4.50 | 0.98 [0.96-1.00] | within 5 % |" in md
    assert "| 0.90 [0.88-0.92] | **misses by 10.0 %** |" in md
    assert "at every point: no: dflash in512 b4 T0.0 (misses by 10.0 %)" in md
    assert sweep_report((4,), {"dflash": 8}, [close])["all_within"]


def test_k_sweep_sets_the_policys_final_estimates_beside_the_fixed_runs_measurements():
    """Each point keeps, per fixed K, the policy's step ms at the point's batch bucket and its expected
    tokens a step, beside the fixed run's median whole-block step and acceptance length; the report
    gives both as tokens per ms. A K the policy never timed reads n/a."""
    from blockspec.bench.ksweep import policy_record, sweep_lines, sweep_point, sweep_report
    from blockspec.speculative.policy import PolicyView

    view = PolicyView({8: 3, 15: 5}, {(4, 8): 0.0086, (4, 15): 0.0102, (2, 8): 0.0050}, {8: 5.3, 15: 6.4}, [], 0)
    policy = _run([95.0, 96.0, 97.0], batch=3, policy_view=policy_record(view))  # batch 3: bucket 4
    fixed = [_run([100.0] * 3, fixed_k=k, acceptance={"mean_acceptance_length": acc},
                  steps_by_draft_length={str(k): {"steps": 9, "ms_median": ms}, "1": {"steps": 1, "ms_median": 1.0}})
             for k, ms, acc in ((8, 8.75, 5.26), (15, 10.9, 6.1), (4, 7.0, 4.0))]
    point = sweep_point(policy, fixed)
    assert point["beliefs"] == [
        {"k": 4, "believed_ms": None, "believed_tokens": None, "measured_ms": 7.0, "measured_tokens": 4.0},
        {"k": 8, "believed_ms": pytest.approx(8.6), "believed_tokens": 5.3, "measured_ms": 8.75, "measured_tokens": 5.26},
        {"k": 15, "believed_ms": pytest.approx(10.2), "believed_tokens": 6.4, "measured_ms": 10.9,
         "measured_tokens": 6.1}]
    md = "\n".join(sweep_lines(sweep_report((4, 8, 15), {"dflash": 15}, [point])))
    assert ("- dflash in512 b3 T0.0, the policy's final estimates against the fixed runs (step ms x tokens a step "
            "= tokens per ms): K=4 believed n/a ms x n/a = n/a, measured 7.00 ms x 4.00 = 0.571; K=8 believed "
            "8.60 ms x 5.30 = 0.616, measured 8.75 ms x 5.26 = 0.601; K=15 believed 10.20 ms x 6.40 = 0.627, "
            "measured 10.90 ms x 6.10 = 0.560") in md


def test_k_sweep_runs_each_fixed_k_in_the_same_rounds_and_reports_the_policy_against_the_best(tmp_path):
    """--k-sweep 3,15 on the tiny drafters (DFlash block 8: 7 drafts; DSpark anchor-first: 8): each method
    also runs at K = 3 (one of the policy's draft lengths) and at its block's size (15 clipped, said so), no
    step of a fixed run drafting more than K; the JSON and the markdown give each K's figures, the best K and
    the policy's ratio and verdict, and the fixed runs stay out of the main table."""
    cfg = BenchConfig(**{**TINY_RUN, "speculative_config": {}, "repeats": 2}, batch_sizes=(2,), output_len=12,
                      synthetic_acceptance="6.5", k_sweep=(3, 15))
    res = run_bench(cfg)
    assert [(r["method"], r["batch"]) for r in res["runs"]] == [("plain", 2), ("dflash", 2), ("dspark", 2)]
    sweep = json.loads(json.dumps(res))["k_sweep"]
    assert sweep["methods"] == {"dflash": {"capacity": 7, "k": [3, 7]}, "dspark": {"capacity": 8, "k": [3, 8]}}
    assert "dflash: its block holds 7 drafts (K in 1-7); K=15 run as K=7" in sweep["notes"]
    assert [(p["method"], p["input_len"], p["batch"]) for p in sweep["points"]] == [("dflash", 8, 2), ("dspark", 8, 2)]
    for p in sweep["points"]:
        policy = next(r for r in res["runs"] if r["method"] == p["method"])
        assert p["policy_decode_tok_s"] == policy["decode_tok_s"]["median"]
        by_k = {r["fixed_k"]: r for r in p["fixed"]}
        assert set(by_k) == set(sweep["methods"][p["method"]]["k"])
        for k, run in by_k.items():
            assert run["acceptance"]["num_speculative_tokens"] == k and run["acceptance"]["num_drafts"] > 0
            assert max(map(int, run["steps_by_draft_length"])) == k  # fixed: no step drafts more than K
            assert len(run["rounds"]["decode_tok_s"]) == 2 and run["decode_tok_s"]["median"] > 0
        best = max(by_k.values(), key=lambda r: r["decode_tok_s"]["median"])
        assert p["best_k"] == best["fixed_k"]
        ratios = [a / b for a, b in zip(policy["rounds"]["decode_tok_s"], best["rounds"]["decode_tok_s"])]
        assert p["policy_over_best"] == pytest.approx(sum(ratios) / 2)  # median of two rounds
        assert p["within"] == (p["policy_over_best"] >= 0.95) and p["verdict"].startswith(
            "within" if p["within"] else "misses by")
    md = write_outputs(res, tmp_path, plots=False)["markdown"].read_text()
    assert "Fixed-K sweep (`--k-sweep 3,15`)" in md and "| K=3 | K=7 | K=8 | best K |" in md
    section = md.split("Fixed-K sweep")[1]
    row = next(line for line in section.splitlines() if line.startswith("| dspark (synthetic) | 2 | 0.0 | 8 | "))
    assert row.count(" / ") == 3 and sweep["points"][1]["verdict"] in row  # two K cells, the acceptance cell
    point = sweep["points"][1]
    assert f"| {point['policy_acceptance_length']:.2f} / {point['best_acceptance_length']:.2f} |" in row
    assert "the policy within 5 % of the best fixed K at every point: " in md
    for p in sweep["points"]:  # the policy's own estimates of the Ks at this batch, beside each fixed run's
        assert [b["k"] for b in p["beliefs"]] == sweep["methods"][p["method"]]["k"]
        assert all(b["measured_ms"] > 0 and b["measured_tokens"] >= 1 for b in p["beliefs"])
        view = next(r for r in res["runs"] if r["method"] == p["method"])["policy_view"]
        for b in p["beliefs"]:  # which Ks the policy timed depends on the machine's speed; what it believed of each
            assert b["believed_ms"] == view["step_ms"].get(f"{batch_bucket(2)}:{b['k']}")
            assert b["believed_tokens"] == view["expected_tokens"].get(str(b["k"]))
        assert any(b["believed_tokens"] is not None for b in p["beliefs"])
    assert "the policy's final estimates against the fixed runs" in md


def test_k_sweep_refuses_what_it_cannot_check():
    for given, match in ((dict(k_sweep=(0, 4)), "draft lengths K >= 1"),
                         (dict(k_sweep=(4,), methods=("plain",)), "none is selected"),
                         (dict(k_sweep=(4,)), "leave adaptive_draft_length on")):  # TINY_RUN pins the draft length
        with pytest.raises(ConfigError, match=match):
            run_bench(BenchConfig(**TINY_RUN, **given))


def test_bench_options_that_cannot_run_are_named_before_any_work(tmp_path, capsys):
    """An empty method list, a speculative config that is not an object, a DSpark block of 0, and an --out
    that is a file (the sweep used to run in full, then fail at its first write)."""
    for given, match in ((dict(methods=()), "--methods is empty"),
                         (dict(speculative_config=[1]), "--speculative-config must be a JSON object"),
                         (dict(dspark_block_size=0), "--dspark-block-size must be an integer >= 1")):
        with pytest.raises(ConfigError, match=match):
            run_bench(BenchConfig(**{**TINY_RUN, **given}))
    from blockspec.cli import main

    blocker = tmp_path / "f"
    blocker.write_text("x")
    assert main(["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--out", str(blocker)]) == 2
    assert capsys.readouterr().err.endswith(f"error: --out {blocker}: exists and is not a directory\n")
    assert main(["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--out", str(blocker / "sub")]) == 2
    assert capsys.readouterr().err.endswith(f"error: --out {blocker}/sub: {blocker} is a file, not a directory\n")


def test_trace_policy_writes_what_each_speculative_policy_saw_and_chose(tmp_path):
    """--trace-policy: one trace per speculative engine of the point (the fixed-K sweep's too), over the timed
    passes (at least a choice per timed decode step; on the CPU each step's time right after its choice, at
    the same batch and K) and apart over the warm-up pass they start from, written to policy_trace.json and
    kept out of bench.json; refused without a speculative method. Given draft lengths (3 and 5) are the
    policy's: the fixed-K engines of the sweep (K = 2, below them) run without them."""
    cfg = BenchConfig(**{**TINY_RUN, "speculative_config": {"draft_length_candidates": [3, 5]}, "repeats": 2},
                      batch_sizes=(2,), output_len=12, synthetic_acceptance="6.5", k_sweep=(2,), trace_policy=True)
    res = run_bench(cfg)
    traces = res["policy_traces"]
    assert [(t["method"], t["fixed_k"], t["batch"], t["temperature"]) for t in traces] == [
        ("dflash", None, 2, 0.0), ("dspark", None, 2, 0.0), ("dflash", 2, 2, 0.0), ("dspark", 2, 2, 0.0)]
    for t in traces:
        kinds = [e[0] for e in t["events"]]
        choices = [e[2] for e in t["events"] if e[0] == "choice"]
        steps = sum(v["steps"] for r in res["runs"] + [f for p in res["k_sweep"]["points"] for f in p["fixed"]]
                    if r["method"] == t["method"] and r.get("fixed_k") == t["fixed_k"]
                    for v in r["steps_by_draft_length"].values())
        assert len(choices) >= steps > 0 and "acceptance" in kinds
        warmup = [e[2] for e in t["warmup_events"] if e[0] == "choice"]  # a fresh policy's: plain is timed first
        assert warmup[0] == (0 if t["fixed_k"] is None else t["fixed_k"])
        assert any(e[0] == "acceptance" for e in t["warmup_events"])
        if t["fixed_k"] is not None:
            assert set(choices) == {t["fixed_k"]}  # the given draft lengths (up to 5) are the policy's alone
        else:
            assert set(choices) <= {0, 3, 5, 7, 8}
        steps_seen = [e for e in t["events"] if e[0] != "acceptance"]
        assert all(before[0] == "choice" and before[1:3] == e[1:3]
                   for before, e in zip(steps_seen, steps_seen[1:]) if e[0] == "time")
    paths = write_outputs(res, tmp_path, plots=False)
    assert json.loads(paths["policy_trace"].read_text()) == json.loads(json.dumps(traces))
    assert "policy_traces" not in json.loads(paths["json"].read_text()) and "policy_traces" in res
    plain = run_bench(BenchConfig(**TINY_RUN, batch_sizes=(2,), output_len=4, methods=("plain", "dflash")))
    assert "policy_traces" not in plain and "policy_trace" not in write_outputs(plain, tmp_path / "b", plots=False)
    with pytest.raises(ConfigError, match="none is selected"):
        run_bench(BenchConfig(**TINY_RUN, methods=("plain",), trace_policy=True))


# ------------------------------------------------------------------------------------------- real checkpoints
def test_real_checkpoints_and_prompt_files(tmp_path):
    fixtures = Path(__file__).parent / "fixtures" / "drafters"
    target = save_drafter_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": list(range(2, 2 + n))}) for n in (5, 9)) + "\n")
    cfg = BenchConfig(model=str(target), dflash_model=str(fixtures / "dflash"), prompts=str(prompts),
                      batch_sizes=(2,), output_len=12, repeats=1, device="cpu", speculative_config=FULL_DRAFTS,
                      peers=("transformers",))
    runs = {r["method"]: r for r in run_bench(cfg)["runs"]}
    assert runs["dflash"]["prefix_match_plain"] == 1.0 and runs["dflash"]["prompt_tokens_mean"] == 7
    assert runs["hf-generate"]["prefix_match_plain"] == 1.0
    assert "--peer-assistant" in runs["hf-assisted"]["reason"]


def test_builtin_text_prompts_use_the_tokenizer(tmp_path):
    model = save_tiny_model_with_tokenizer(tmp_path / "m", "qwen3", seed=1)
    res = run_bench(BenchConfig(model=str(model), prompts="builtin", batch_sizes=(2,), output_len=4, repeats=1,
                                device="cpu"))
    (run,) = res["runs"]
    assert run["method"] == "plain" and run["prompt_tokens_mean"] > 40  # chat-templated text, one id per char


def test_passes_do_not_sync_the_device_between_steps(monkeypatch):
    """The engine launches each step before committing the last one; a device sync after every step
    would idle the GPU for each step's host work and price it into every figure. A pass syncs when
    it starts and when it ends, however many steps it runs."""
    from blockspec.bench import harness

    syncs = []
    monkeypatch.setattr(harness, "synchronize", lambda device: syncs.append(device))
    target = random_target(TINY, 256, "cpu", torch.float32)
    engine = Engine(target, None, EngineConfig(max_model_len=96, max_num_seqs=2))
    engine.spec_totals = harness.StepLog()  # as build_engine sets it
    result = harness.drive(engine, [[5, 6, 7], [8, 9]], [SamplingParams(temperature=0, max_tokens=20,
                                                                        ignore_eos=True)] * 2)
    assert engine.num_steps >= 20 and result.tokens == 40
    assert len(syncs) == 2


def test_waves_hold_the_concurrency_and_refill_finished_slots(tmp_path, monkeypatch):
    """--waves 3 at batch 2: six requests a point, never more than two running; the report says how the
    point's requests arrived."""
    from blockspec.bench import harness

    running: list[int] = []
    step = Engine.step

    def counted(self):
        running.append(len(self.running))
        return step(self)

    monkeypatch.setattr(Engine, "step", counted)
    out = tmp_path / "waves"
    assert main(["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--methods", "plain",
                 "--batch-sizes", "2", "--waves", "3", "--input-len", "8", "--output-len", "6", "--repeats", "1",
                 "--no-plots", "--out", str(out)]) == 0
    (run,) = json.loads((out / "bench.json").read_text())["runs"]
    assert run["num_requests"] == 6 and max(running) == 2
    assert all(0 < v["requests_mean"] <= 2 for v in run["steps_by_draft_length"].values())
    assert "3 x batch requests a point, at most batch in flight" in (out / "bench.md").read_text()
    assert harness.BenchConfig(random_weights=True).waves == 1  # without --waves: one static batch


def test_a_call_that_only_launches_is_priced_in_the_next_commit(monkeypatch):
    """A pipelined plain step's first call launches and commits nothing; its time belongs to the step
    the next call commits, not to a short step of its own. Scripted calls: a launch-only call of 1 s,
    then a plain commit of 3 s; a speculative commit (K = 4) of 5 s; a plain commit of 2 s."""
    from blockspec.bench import harness

    clock = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(harness, "synchronize", lambda device: None)
    script = [(1.0, 0, []), (3.0, 1, []), (5.0, 3, [(4, 2)]), (2.0, 1, [])]  # seconds, tokens, (drafts, accepted)

    class Scripted:
        device, waiting, running, num_preemptions, num_generated = torch.device("cpu"), [], [], 0, 0

        def __init__(self):
            self.spec_totals, self.left = harness.StepLog(), list(script)

        def add_request(self, *args):
            return [types.SimpleNamespace(error=None, output_ids=[1, 2, 3, 4, 5], first_token_time=0.0,
                                          arrival_time=0.0, finish_time=11.0)]

        def has_unfinished(self):
            return bool(self.left)

        def step(self):
            seconds, tokens, spec = self.left.pop(0)
            clock[0] += seconds
            self.num_generated += tokens
            for n, a in spec:
                self.spec_totals.record(n, a)

    result = harness.drive(Scripted(), [[1]], [SamplingParams()])
    assert result.step_s == {0: [4.0, 2.0], 4: [5.0]}
    assert result.decode_s == 11.0 and result.decode_tokens == 5


def test_kernel_benchmark_records_keep_every_run(monkeypatch, capsys):
    """The kernel benchmarks' JSON: a header naming the GPU, torch and the measured bandwidth (in
    TB/s), the benchmark's own fields, and each run appended and printed as one JSON line."""
    from blockspec.bench.timing import add_run, kernel_record

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    record = kernel_record(4.25e12, vocab=7)
    assert record["gpu"] == "test GPU" and record["copy_bandwidth_TBps"] == 4.25 and record["vocab"] == 7
    add_run(record, {"rows": 1, "us": 2.5})
    add_run(record, {"rows": 2, "us": 3.5})
    assert record["runs"] == [{"rows": 1, "us": 2.5}, {"rows": 2, "us": 3.5}]
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == record["runs"]


def _script(name: str):
    """benchmarks/<name>.py, a script, not part of the package, loaded as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_step_trace_records_every_step_and_leaves_the_engine_as_it_was():
    """benchmarks/step_trace.py: each engine step of a pass is timed with the requests it prefilled (every
    prompt once: the sum over steps is the number of requests) and decoded (never more than in flight), and
    the speculative steps it launched; `split` sums the calls' times; afterwards the engine has none of the
    wrappers."""
    trace = _script("step_trace")
    from blockspec.demo import default_pair, heldout_prompts
    from blockspec.llm import LLM

    base, _ = default_pair()
    llm = LLM(str(base / "target"), device="cpu", dtype="float32", seed=0, max_num_seqs=2,
              speculative_config={"method": "dspark", "model": str(base / "dspark"), "adaptive_draft_length": False})
    prompts = heldout_prompts(5)
    wall, tokens, steps, totals = trace.traced_pass(llm, prompts, SamplingParams(temperature=0, max_tokens=6,
                                                                                 ignore_eos=True), split=True)
    assert tokens == 30 and wall > 0 and all(s["ms"] > 0 for s in steps)
    assert sum(s.get("prefill", 0) for s in steps) == 5 and max(s.get("decode", 0) for s in steps) <= 2
    assert any(k > 0 for s in steps for _, k, _ in s.get("launch", []))  # it drafted
    assert totals["_prefill"][1] == sum(1 for s in steps if s.get("prefill")) and totals["_decode"][0] > 0
    assert not {"_step", "_prefill", "_decode", "_launch_spec", "_schedule", "_append"} & set(vars(llm.engine))
    assert "forward" not in vars(llm.engine.runner) and "sample" not in vars(llm.engine.sampling)
    lines = trace.report("dspark", wall, tokens, steps, totals)
    assert lines[0].startswith(f"dspark: 30 tokens in {1e3 * wall:.1f} ms") and any("[split] _prefill" in x for x in lines)


def test_step_trace_timeline_splits_the_device_time_into_busy_and_idle_by_step():
    """`trace_kernels` credits each device kernel to the step whose host range holds its launch call (a graph's
    kernels to the replay's step, though they run in the next step's range) and ignores the step ranges the profiler
    projects onto the device (counted as work, they hid every idle gap); `device_idle` gives a step the union of its
    kernels and the device's idle gaps of at least min_gap inside its host range. With `marks` each step of a pass is
    a profiler range the timeline reads."""
    trace = _script("step_trace")
    mark = trace.STEP_MARK
    events = [
        {"ph": "X", "cat": "user_annotation", "name": f"{mark}0", "ts": 0.0, "dur": 100.0},
        {"ph": "X", "cat": "user_annotation", "name": f"{mark}1", "ts": 100.0, "dur": 100.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": f"{mark}0", "ts": 10.0, "dur": 180.0},  # not work
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 5.0, "dur": 3.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 80.0, "dur": 2.0,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 150.0, "dur": 2.0,
         "args": {"correlation": 3}},
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 10.0, "dur": 20.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 20.0, "dur": 30.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 52.0, "dur": 8.0, "args": {"correlation": 1}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "m", "ts": 90.0, "dur": 50.0, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "d", "ts": 180.0, "dur": 10.0, "args": {"correlation": 3}},
    ]
    kernels, steps = trace.trace_kernels(events)
    assert steps == {0: (0.0, 100.0), 1: (100.0, 200.0)}
    assert sorted(kernels) == [(10.0, 30.0, 0), (20.0, 50.0, 0), (52.0, 60.0, 0), (90.0, 140.0, 0), (180.0, 190.0, 1)]
    idle = trace.device_idle(kernels, steps, min_gap=5.0)
    assert idle[0] == {"busy_us": 40.0 + 8.0 + 50.0, "idle_us": 30.0, "gaps": 1}  # 52-60 follows a 2 us gap: none
    assert idle[1] == {"busy_us": 10.0, "idle_us": 40.0, "gaps": 1}
    # a gap across two steps' ranges is split between them
    spanning = trace.device_idle([(0.0, 80.0, 0), (130.0, 150.0, 1)], steps)
    assert spanning[0]["idle_us"] == 20.0 and spanning[1]["idle_us"] == 30.0
    assert trace.device_idle([], steps) == {i: {"busy_us": 0.0, "idle_us": 0.0, "gaps": 0} for i in steps}

    from blockspec.demo import default_pair, heldout_prompts
    from blockspec.llm import LLM
    from torch.profiler import ProfilerActivity, profile

    base, _ = default_pair()
    llm = LLM(str(base / "target"), device="cpu", dtype="float32", seed=0, max_num_seqs=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, _, recorded, _ = trace.traced_pass(llm, heldout_prompts(3), SamplingParams(temperature=0, max_tokens=4),
                                              split=False, marks=True)
    marks = sorted(int(e.name[len(trace.STEP_MARK):]) for e in prof.events() if e.name.startswith(trace.STEP_MARK))
    assert marks == list(range(len(recorded))) and len(recorded) >= 4


def test_cpu_ab_swaps_an_arm_in_for_its_runs_only_and_pairs_them():
    """`swapped` sets instance attributes for its context and restores them (one the instance did not hold is
    deleted, so the class's shows again, also after an error); `paired` runs each arm on every unit and mode
    inside its context, and reports each arm's time over the first arm's and whether the outputs agree."""
    ab = _script("cpu_ab")

    class Thing:
        def act(self):
            return "class"

    thing = Thing()
    thing.size = 1
    with ab.swapped([(thing, "act", lambda: "arm"), (thing, "size", 2)]):
        assert thing.act() == "arm" and thing.size == 2
    assert thing.act() == "class" and thing.size == 1 and "act" not in thing.__dict__
    with pytest.raises(RuntimeError), ab.swapped([(thing, "size", 3)]):
        raise RuntimeError
    assert thing.size == 1

    llm = ab.embedded_llm("dflash")
    proposer, calls = llm.engine.proposer, []
    propose = proposer.propose

    def counted(*args, **kwargs):
        calls.append(1)
        return propose(*args, **kwargs)

    arms = {"as is": lambda: ab.swapped([]), "counted": lambda: ab.swapped([(proposer, "propose", counted)])}
    result = ab.paired(llm, arms, rounds=1, modes=("plain", "spec"), max_tokens=6)
    assert calls and "propose" not in proposer.__dict__  # the arm drafted, and left the engine as it was
    assert result["outputs_agree"] and result["units"] == 8
    assert set(result["over_as is"]) == {"as is, plain", "as is, spec", "counted, plain", "counted, spec"}
    assert result["over_as is"]["as is, spec"] == [1.0, 1.0, 1.0] and set(result["spec_over_plain"]) == set(arms)


def test_load_test_summary_gives_the_geometric_mean_and_a_bootstrap_interval():
    """The load test's verdict on "speculation never below plain" is the geometric mean of the rounds'
    on / off ratios and its bootstrap interval: exact for known rounds, bracketing the mean, a point
    for identical rounds, below 1 for rounds that all lose, and pooled over cells."""
    lt = _script("load_test")
    mean, low, high = lt.geomean_interval([0.5, 2.0, 1.0, 1.0])
    assert mean == pytest.approx(1.0) and low < 1.0 < high
    assert lt.geomean_interval([0.9] * 6) == pytest.approx((0.9, 0.9, 0.9))
    losing = [0.95, 0.97, 0.96, 0.94, 0.98, 0.96, 0.95, 0.97]
    mean, low, high = lt.geomean_interval(losing)
    assert mean == pytest.approx(math.exp(sum(map(math.log, losing)) / len(losing)))
    assert min(losing) <= low < mean < high < 1.0
    assert lt.geomean_interval(losing) == lt.geomean_interval(losing)  # seeded

    def cell(level, temp, spec, rnd, tok_s):
        return lt.Cell(level, temp, spec, 1, 0, 1, 1.0, tok_s, {}, {}, None, round=rnd)

    cells = [cell(16, 0.0, True, 0, 90.0), cell(16, 0.0, False, 0, 100.0),
             cell(16, 0.0, False, 1, 100.0), cell(16, 0.0, True, 1, 110.0),
             cell(64, 0.0, True, 0, 200.0), cell(64, 0.0, False, 0, 250.0)]
    rows = lt.ratios(cells)
    assert [r["level"] for r in rows] == [16, 64, "all"]
    assert rows[0]["on_over_off"] == [0.9, 1.1] and rows[1]["on_over_off"] == [0.8]
    assert rows[2]["geomean_on_over_off"][0] == pytest.approx((0.9 * 1.1 * 0.8) ** (1 / 3), abs=1e-3)
    assert "| all | all | - | - | (pooled) |" in lt.markdown(cells, "t")


def test_load_test_warm_up_rounds_run_first_and_are_not_reported(tmp_path, monkeypatch):
    """`--warmup-rounds N` runs N on / off rounds of each cell before the timed ones (a server's policy then
    prices what it has learnt, not its exploration); the report keeps the timed rounds only, numbered from
    1, and says how many warm-up rounds there were. A negative count is refused."""
    lt = _script("load_test")
    calls = []

    def fake_cell(pool, processes, url, model, prompts, level, temperature, spec, max_tokens, timeout):
        calls.append(spec)
        tok_s = 100.0 + len(calls)  # each call its own figure, so a kept warm-up round would show
        return (lt.Cell(level, temperature, spec, len(prompts), 0, 8, 1.0, tok_s, {}, {}, None),
                [lt.Outcome(True, [1, 2])] * len(prompts))

    monkeypatch.setattr(lt, "run_cell", fake_cell)
    monkeypatch.setattr(lt, "policy_steps", lambda url: {})
    out = tmp_path / "lt"
    args = ["--url", "http://127.0.0.1:1", "--levels", "2", "--temperatures", "0", "--requests", "2",
            "--client-processes", "1", "--rounds", "2", "--out", str(out)]
    assert lt.main(args + ["--warmup-rounds", "3"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert len(calls) == 1 + 2 * (3 + 2)  # the server's warm-up request, then 3 untimed and 2 timed rounds
    assert [(c["round"], c["tok_per_s"]) for c in report["cells"]] == [(0, 108.0), (0, 109.0), (1, 110.0), (1, 111.0)]
    assert "after 3 warm-up round(s)" in report["title"]
    calls.clear()
    assert lt.main(args) == 0 and len(calls) == 1 + 2 * 2  # none by default
    with pytest.raises(SystemExit):
        lt.main(args + ["--warmup-rounds", "-1"])


def test_engines_that_take_turns_share_one_kv_store():
    """An engine's n-th cache built under a SharedKVStore takes the tensors an earlier engine's n-th cache
    of the same shape took, zeroed; another shape, or a cache built outside, gets its own; layers never share."""
    from blockspec.models.kv_cache import KVCache, SharedKVStore

    store = SharedKVStore()
    with store.engine():
        a_draft, a_target = KVCache(1, 2, 8, 32, torch.float32, "cpu", 2), KVCache(2, 2, 8, 32, torch.float32, "cpu", 2)
        a_twin = KVCache(2, 2, 8, 32, torch.float32, "cpu", 2)  # the same shape twice in one engine: its own
    a_target.k[0].fill_(3.0)
    with store.engine():  # built in another order, as a plain engine (no drafter) builds its target's first
        b_target, b_draft = KVCache(2, 2, 8, 32, torch.float32, "cpu", 2), KVCache(1, 4, 8, 32, torch.float32, "cpu", 2)
    assert a_twin.k[0].data_ptr() != a_target.k[0].data_ptr()
    assert [t.data_ptr() for t in b_target.k + b_target.v] == [t.data_ptr() for t in a_target.k + a_target.v]
    assert not a_target.k[0].any()  # zeroed for its new owner, as a new cache's tensors are
    assert len({t.data_ptr() for t in a_target.k + a_target.v}) == 4
    assert b_draft.k[0].data_ptr() != a_draft.k[0].data_ptr()  # another shape: its own
    assert KVCache(2, 2, 8, 32, torch.float32, "cpu", 2).k[0].data_ptr() != a_target.k[0].data_ptr()
    assert store.bytes == a_target.bytes + a_twin.bytes + a_draft.bytes + b_draft.bytes


def test_a_points_engines_hold_one_engines_kv_memory(monkeypatch):
    """The bench builds a point's engines (plain, DFlash, DSpark and the fixed-K ones) on one SharedKVStore
    with one page count, so the point holds the KV memory of its largest engine, not of every engine; the
    speculative outputs still equal plain decoding's."""
    from blockspec.bench import harness
    from blockspec.models.kv_cache import SharedKVStore

    stores: list[SharedKVStore] = []

    class Recorded(SharedKVStore):
        def __init__(self) -> None:
            super().__init__()
            stores.append(self)

    monkeypatch.setattr(harness, "SharedKVStore", Recorded)
    res = run_bench(BenchConfig(**{**TINY_RUN, "speculative_config": {}}, batch_sizes=(2,), output_len=8, k_sweep=(2,)))
    assert len(stores) == 1
    runs = {r["method"]: r for r in res["runs"]}
    assert runs["dflash"]["prefix_match_plain"] == 1.0 and runs["dspark"]["prefix_match_plain"] == 1.0
    kv = [r["memory_gb"]["target_kv"] + r["memory_gb"].get("draft_kv", 0.0) for r in res["runs"]]
    assert stores[0].bytes / 1e9 == pytest.approx(max(kv), rel=1e-9) and max(kv) < sum(kv)


def test_moe_routing_models_a_random_moe_targets_verify_rows():
    """--moe-routing sets the expert_union routing model on a random MoE target and says so in the report;
    it is refused for a dense arch, and without synthetic acceptance (its verify rows route unlike decode)."""
    from blockspec.bench import harness

    used: list[str] = []
    base = dict(random_weights=True, arch="tiny-moe", input_len=(8,), repeats=1, device="cpu", batch_sizes=(1,),
                output_len=6, synthetic_acceptance="6.5")
    real = harness.set_routing
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness, "set_routing", lambda model, name: used.append(name) or real(model, name))
        res = run_bench(BenchConfig(**base, moe_routing="uniform"))
    assert used == ["uniform"] and "uniform routing" in res["model"]["target"]
    assert all(r["status"] == "ok" for r in res["runs"])
    with pytest.raises(ConfigError, match="--moe-routing local .* MoE --arch"):
        BenchConfig(**{**base, "arch": "tiny"}, moe_routing="local").validate()
    with pytest.raises(ConfigError, match="give --synthetic-acceptance"):
        BenchConfig(**{**base, "synthetic_acceptance": None}, moe_routing="uniform").validate()
    with pytest.raises(ConfigError, match="allowed: own, uniform, local"):
        BenchConfig(**base, moe_routing="random").validate()


def test_an_fp8_drafter_runs_in_the_bench_and_says_so():
    """--speculative-config '{"quantization": "fp8"}' quantizes the random drafters (their weight bytes
    shrink) and the report's dtype names them."""
    base = dict(random_weights=True, arch="tiny", input_len=(8,), repeats=1, device="cpu", batch_sizes=(1,),
                output_len=6, synthetic_acceptance="6.5", methods=("plain", "dflash"))
    plain = run_bench(BenchConfig(**base))
    fp8 = run_bench(BenchConfig(**base, speculative_config={"quantization": "fp8"}))
    assert "fp8 drafters" in fp8["model"]["dtype"] and "fp8 drafters" not in plain["model"]["dtype"]
    weights = [next(r for r in res["runs"] if r["method"] == "dflash")["memory_gb"]["drafter_weights"]
               for res in (plain, fp8)]
    assert weights[1] < weights[0]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_row_flops_count_every_product_a_verify_row_makes(tmp_path, family):
    """`row_flops`' products are what torch's FLOP counter sees in a 3-row verify forward and its LM head,
    dense and mixture-of-experts (a row multiplies its top-k experts' weights, not the layer's)."""
    from torch.utils.flop_counter import FlopCounterMode

    from blockspec.bench.arch import row_flops
    from blockspec.models.kv_cache import causal_meta
    from blockspec.models.loader import load_target

    path = save_tiny(tmp_path / "t", family) if family == "qwen3" else save_moe_target(tmp_path / "t", family)
    model, _ = load_target(str(path), device="cpu", dtype="float32")
    cfg, ctx, rows = model.config, 37, 3
    cache = model.new_cache(1, 64)
    prefill = causal_meta([0], [0], [ctx], ctx, cache.trash, "cpu", cfg.sliding_window, cfg.layer_types, ctx)
    model(torch.arange(ctx)[None] % cfg.vocab_size, prefill, cache, ())
    verify = causal_meta([0], [ctx], [rows], rows, cache.trash, "cpu", cfg.sliding_window, cfg.layer_types, ctx + rows)
    with FlopCounterMode(display=False) as counter:
        hidden, _ = model(torch.ones(1, rows, dtype=torch.int64), verify, cache, ())
        model.compute_logits(hidden)
    products, per_key = row_flops(model)
    assert counter.get_total_flops() == rows * products
    assert per_key == 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim


def test_draft_step_terms_count_the_drafters_products_and_the_head_it_streams():
    """The draft phase of a step floor: every layer weight once a block row, the fc once a context row, the
    LM head once a draft (the target's, which a shared head streams again), and bytes of layers, fc and head."""
    from blockspec.bench.arch import draft_step_terms, get_arch, random_drafter, random_target

    arch = get_arch("tiny")
    target = random_target(arch.target, 64, device="cpu", dtype=torch.float32)
    drafter = random_drafter(arch.dflash, device="cpu", dtype=torch.float32)
    terms = draft_step_terms(drafter, target)
    linears = sum(m.weight.numel() for layer in drafter.layers for m in layer.modules() if isinstance(m, nn.Linear))
    assert terms["layer_gflops_per_row"] == pytest.approx(2 * linears / 1e9)
    assert terms["fc_gflops_per_row"] == pytest.approx(2 * drafter.fc.weight.numel() / 1e9)
    assert not drafter.use_own_head and terms["head_gflops_per_row"] == pytest.approx(2 * target.lm_head.weight.numel() / 1e9)
    assert terms["head_bytes_gb"] == pytest.approx(target.lm_head.weight.numel() * 4 / 1e9)
    assert terms["weight_bytes_gb"] == pytest.approx((linears + drafter.fc.weight.numel()) * 4 / 1e9)
    assert terms["block_rows"] == drafter.block_size and terms["draft_row_offset"] == 1
    last = drafter.layers[-1]
    after_qkv = sum(m.weight.numel() for m in last.modules() if isinstance(m, nn.Linear)) - last.self_attn.qkv_proj.weight.numel()
    assert terms["trimmed_gflops_per_row"] == pytest.approx(2 * after_qkv / 1e9)


def test_a_step_floor_is_its_weights_until_its_rows_fill_the_products():
    """A step's floor is its weight bytes at the copy bandwidth while it has few rows, then its FLOPs at the
    product rate; its attention (each request's K/V read once) and the draft's products and attention come
    after, each at its own bound; each run's step times by draft length get the floor of a step of the
    requests those steps decoded."""
    from blockspec.bench.report import add_step_floors, occupancy, step_floor

    # 16 GB a step at 4 TB/s: 4 ms; a row 16 GFLOP at 800 TFLOP/s: 0.02 ms, so 200 rows cross over
    model = {"weight_bytes_per_step_gb": 16.0, "row_gflops": 16.0, "attention_flops_per_key": 0.0}
    floor = {"copy_bandwidth_TBps": 4.0, "matmul_TFLOPs": 800.0}
    assert step_floor(model, floor, 1, 0, 0) == pytest.approx((4e-3, "products bandwidth"))
    assert step_floor(model, floor, 199, 0, 0)[1] == "products bandwidth"
    assert step_floor(model, floor, 400, 0, 0) == pytest.approx((8e-3, "products compute"))
    # K/V read once a request: 64 x 1000 keys x 0.1 MB = 6.4 GB, 1.6 ms at 4 TB/s, after the products
    model["kv_bytes_per_token"] = 1e5
    assert step_floor(model, floor, 64, 0, 1000) == pytest.approx((5.6e-3, "products bandwidth, attention bandwidth"))
    verify = 64 * 9 * 16e9 / 800e12 + 1.6e-3  # 576 rows of products, then the K/V
    assert step_floor(model, floor, 64, 8, 1000) == pytest.approx((verify, "products compute, attention bandwidth"))
    # the draft: 64 requests x (16 block rows x 2 GFLOP - 7 rows past the 8 drafts' 9 x 0.3 GFLOP the last
    # layer skips + 0.1 GFLOP fc + 8 drafts x 1.2 GFLOP of head) = 2.53 TFLOP, 3.17 ms, against 3.2 GB of
    # weights (0.8 ms); its K/V 64 x 1000 x 10 kB, 0.16 ms
    drafter = {"weight_bytes_gb": 2.0, "head_bytes_gb": 1.2, "block_rows": 16, "draft_row_offset": 1, "layers": 5,
               "layer_gflops_per_row": 2.0, "trimmed_gflops_per_row": 0.3, "fc_gflops_per_row": 0.1,
               "head_gflops_per_row": 1.2, "attention_flops_per_key": 0.0, "kv_bytes_per_token": 1e4}
    spec = verify + 64 * (41.7e9 - 7 * 0.3e9) / 800e12 + 0.16e-3
    assert step_floor(model, floor, 64, 8, 1000, drafter) == pytest.approx(
        (spec, "products compute, attention bandwidth, draft products compute, draft attention bandwidth"))
    assert step_floor(model, floor, 1, 1, 0, drafter) == pytest.approx(
        (4e-3 + 0.8e-3, "products bandwidth, draft products bandwidth"))
    model["drafter_terms"] = {"dflash": drafter}
    run = {"status": "ok", "method": "dflash", "batch": 64, "prompt_tokens_mean": 500, "output_len": 1000,
           "steps_by_draft_length": {"0": {"steps": 5, "ms_median": 7.7}, "8": {"steps": 9, "ms_median": 23.3}}}
    add_step_floors([run], model, floor)
    steps = run["steps_by_draft_length"]
    assert steps["0"]["floor_bound"] == "products bandwidth, attention bandwidth"
    assert steps["0"]["floor_ms"] == pytest.approx(5.6)
    assert steps["8"]["floor_ms"] == pytest.approx(1e3 * spec) and "draft products compute" in steps["8"]["floor_bound"]
    # a draft length taken only while the batch drains is priced at the requests its steps decoded
    draining = {**run, "steps_by_draft_length": {"4": {"steps": 3, "ms_median": 7.2, "requests_mean": 9.6},
                                                 "8": {"steps": 9, "ms_median": 23.3, "requests_mean": 64.0}}}
    add_step_floors([draining], model, floor)
    steps = draining["steps_by_draft_length"]
    assert steps["4"]["floor_ms"] == pytest.approx(1e3 * step_floor(model, floor, 10, 4, 1000, drafter)[0])
    assert steps["4"]["floor_ms"] < 1e3 * step_floor(model, floor, 64, 4, 1000, drafter)[0]
    assert steps["8"]["floor_ms"] == pytest.approx(1e3 * spec)
    assert occupancy(steps["4"], 64) == " at 9.6 requests" and occupancy(steps["8"], 64) == ""
    assert occupancy({"requests_mean": 1.0}, 4) == " at 1 request"
    bare = {**run, "steps_by_draft_length": {"8": {"steps": 9, "ms_median": 23.3}}}
    add_step_floors([bare], model, "n/a (GPU only)")  # no measured rates (the CPU): no floor
    assert bare["steps_by_draft_length"]["8"] == {"steps": 9, "ms_median": 23.3}
