"""`blockspec bench --tensor-parallel-size 2` on CPU: two gloo ranks run the sweep in lockstep and give the
tokens of TP = 1, the report names the TP size, every rank's step figures and the comparison with TP = 1,
and a combination the ranks cannot run is one line of error before any rank process starts."""

from __future__ import annotations

import json

import pytest
import torch

from blockspec.bench import BenchConfig, markdown, run_bench, write_outputs
from blockspec.bench import harness
from blockspec.cli import main
from blockspec.parallel import tp

# The synthetic acceptance draws follow the draft lengths, which an adaptive policy picks from each run's own
# clock: a fixed K makes TP = 1's synthetic tokens the ones TP = 2 must give.
TP_RUN = dict(random_weights=True, arch="tiny", input_len=(8,), repeats=1, device="cpu", batch_sizes=(2,),
              output_len=12, methods=("plain", "dflash"), synthetic_acceptance="4",
              speculative_config={"adaptive_draft_length": False})


@pytest.fixture(scope="module")
def tp2() -> dict:
    """One call: TP = 1 in this process, then TP = 2 on two gloo ranks (rank start-up dominates: one run)."""
    return run_bench(BenchConfig(**TP_RUN, tensor_parallel_size=2, compare_tp1=True))


def test_tp2_gives_tp1_tokens_and_the_report_compares_them(tp2, tmp_path):
    assert tp2["tensor_parallel_size"] == 2 and tp2["config"]["tensor_parallel_size"] == 2
    compare = tp2["compare_tp1"]
    rows = {r["method"]: r for r in compare["rows"]}
    assert set(rows) == {"plain", "dflash"} and all(r["batch"] == 2 and r["temperature"] == 0 for r in rows.values())
    for row in rows.values():  # every output of the last pass, token for token
        assert row["tokens_match_tp1"] == 1.0
        assert row["tp_over_tp1"] == pytest.approx(row["tp_output_tok_s"] / row["tp1_output_tok_s"])
    plain, spec = rows["plain"], rows["dflash"]
    assert plain["tp1_vs_plain"] is None and plain["vs_plain_kept"] is None
    assert spec["synthetic"] and spec["vs_plain_kept"] == pytest.approx(spec["tp_vs_plain"] / spec["tp1_vs_plain"])
    tp_runs = {r["method"]: r for r in tp2["runs"]}
    assert spec["tp_vs_plain"] == tp_runs["dflash"]["vs_plain"]["output_tok_s_ratio"]
    assert tp_runs["dflash"]["acceptance"]["num_drafts"] > 0  # the synthetic run verified drafts on both ranks
    assert [r["method"] for r in compare["tp1"]["runs"]] == ["plain", "dflash"]

    for run in tp2["runs"]:  # each rank's step time and drafter share, with the most of any rank
        ranks = run["ranks"]
        assert len(ranks["step_ms"]) == 2 and ranks["step_ms"][0] == run["step_ms"]["median"]
        assert ranks["step_ms_max"] == max(ranks["step_ms"])
        assert ranks["draft_share_max"] == max(ranks["draft_share"])
    assert tp_runs["plain"]["ranks"]["draft_share"] == [0.0, 0.0]
    assert all(0 < s < 1 for s in tp_runs["dflash"]["ranks"]["draft_share"])

    paths = write_outputs(tp2, tmp_path, plots=False)
    md = paths["markdown"].read_text()
    assert ", TP=2:" in md.splitlines()[0] and "- tensor parallel: 2 rank processes" in md
    assert "| method | batch | T | input | step ms rank 0 | step ms max |" in md
    assert "| plain | 2 | 0.0 | " in md.split("TP=2 against TP=1")[1]
    assert "| dflash (synthetic) | 2 | 0.0 | " in md.split("TP=2 against TP=1")[1]
    assert json.loads(paths["json"].read_text())["compare_tp1"]["rows"][0]["tokens_match_tp1"] == 1.0


def test_a_single_process_report_has_no_tp_sections():
    result = {"tensor_parallel_size": 1, "runs": []}
    from blockspec.bench.tp_report import tp_header, tp_sections

    assert tp_header(result) == [] and tp_sections(result) == []


def test_a_rank_takes_the_fewest_pages_and_rank0s_draft_lengths(monkeypatch):
    """The harness's engines on a rank: KV pages through the ranks' minimum, an adaptive policy's decisions
    through rank 0's (a fixed K needs none), both over the rank's control group."""
    cfg = BenchConfig(**{**TP_RUN, "speculative_config": {}, "synthetic_acceptance": None})
    setup = harness.prepare(cfg, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(tp, "fewest", lambda value, group: seen.append(("pages", value, group)) or value - 1)
    rank0 = lambda decision: decision  # noqa: E731
    monkeypatch.setattr(tp, "rank0_decides", lambda group: seen.append(("agree", group)) or rank0)
    rank = harness.Rank(0, 2, "control")
    drafter = setup.make_drafter("dflash")
    engine = harness.build_engine(cfg, setup, "dflash", drafter, 2, rank)
    assert engine.agree is rank0
    planned = seen[0][1]
    assert seen == [("pages", planned, "control"), ("agree", "control")]
    assert engine.pages.num_pages == planned - 1
    fixed = BenchConfig(**TP_RUN)
    seen.clear()
    assert harness.build_engine(fixed, setup, "dflash", drafter, 2, rank).agree is not rank0
    assert harness.build_engine(fixed, setup, "plain", None, 2).agree(3) == 3 and len(seen) == 2


@pytest.mark.parametrize("flags, message", [
    (["-tp", "3"], "tensor_parallel_size=3 does not divide num_key_value_heads (2)"),
    (["--compare-tp1"], "--compare-tp1 compares a tensor-parallel run with TP = 1"),
    (["-tp", "2", "--peers", "transformers"], "--peers run the whole target in this process"),
    (["-tp", "0"], "--tensor-parallel-size must be an integer >= 1"),
    (["-tp", "2", "--device", "cuda"], "tensor_parallel_size=2 needs that many GPUs; 1 visible"),
], ids=["shapes", "compare-without-tp", "peers", "zero", "gpus"])
def test_bad_combinations_are_one_line_before_any_rank_starts(flags, message, monkeypatch, capsys, tmp_path):
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(tp, "RankProcesses", no_ranks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU visible
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = ["bench", "--random-weights", "--arch", "tiny", "--device", "cpu", "--input-len", "8", "--output-len", "8",
            "--no-plots", "--out", str(tmp_path)]
    assert main(args + flags) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
