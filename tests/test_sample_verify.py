"""Acceptance rules: exact laws by enumeration, the real functions by seeded chi-square over
several verify steps (with negative controls), acceptance lengths, penalties inside a block,
greedy semantics and bad rows."""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from blockspec.sample import verify as verify_mod
from blockspec.sample.processors import RowParams, expand_history, process_logits
from blockspec.sample.sampler import greedy_ids, sample_draft, sample_processed
from blockspec.sample.verify import verify_block, verify_greedy, verify_sample_and_match, verify_standard
from factories import acceptance_cases

V, K = 4, 3
START = V  # context symbol before the first token
T_TARGET = 0.9


def _tables(seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """Order-2 Markov target and draft logits [V+1, V+1, V]: both depend on the drafted prefix."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V + 1, V + 1, V, generator=g, dtype=torch.float64) * 1.5, \
        torch.randn(V + 1, V + 1, V, generator=g, dtype=torch.float64) * 1.5


P_TAB, Q_TAB = _tables()


def _ctx(prefix: tuple[int, ...]) -> tuple[int, int]:
    full = (START, START) + prefix
    return full[-2], full[-1]


def p_dist(prefix: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(P_TAB[_ctx(prefix)] / T_TARGET, 0)


def q_dist(prefix: tuple[int, ...]) -> torch.Tensor:
    return torch.softmax(Q_TAB[_ctx(prefix)], 0)


def q_onehot(prefix: tuple[int, ...]) -> torch.Tensor:
    return torch.nn.functional.one_hot(Q_TAB[_ctx(prefix)].argmax(), V).double()


# ---------------------------------------------------------------- exact laws (explicit formulas)

Law = dict[tuple[int, ...], float]
Dist = Callable[[tuple[int, ...]], torch.Tensor]


def _residual(p: torch.Tensor, q: torch.Tensor, rho: float = 1.0) -> torch.Tensor:
    r = (rho * p - q).clamp(min=0)
    return r / r.sum() if r.sum() > 0 else p


def law_standard(q_fn: Dist, gamma: int, residual: Callable = _residual) -> Law:
    out: Law = defaultdict(float)
    for x in itertools.product(range(V), repeat=gamma):
        reach = math.prod(q_fn(x[:i])[x[i]].item() for i in range(gamma))
        if reach == 0:
            continue
        for i in range(gamma):
            p, q = p_dist(x[:i]), q_fn(x[:i])
            accept = min(1.0, (p[x[i]] / q[x[i]]).item())
            for y, ry in enumerate(residual(p, q).tolist()):
                out[x[:i] + (y,)] += reach * (1 - accept) * ry
            reach *= accept
        for y, py in enumerate(p_dist(x).tolist()):
            out[x + (y,)] += reach * py
    return out


def law_block(q_fn: Dist, gamma: int) -> Law:
    out: Law = defaultdict(float)
    for x in itertools.product(range(V), repeat=gamma):
        pd = math.prod(q_fn(x[:i])[x[i]].item() for i in range(gamma))
        if pd == 0:
            continue
        rho = [1.0]
        for i in range(gamma):
            rho.append(min(1.0, rho[-1] * (p_dist(x[:i])[x[i]] / q_fn(x[:i])[x[i]]).item()))
        z = [(rho[i] * p_dist(x[:i]) - q_fn(x[:i])).clamp(min=0).sum().item() for i in range(gamma)]
        h = [None] + [z[i] / (z[i] + 1 - rho[i]) if z[i] + 1 - rho[i] > 0 else 1.0 for i in range(1, gamma)]
        h.append(rho[gamma])
        for t in range(gamma + 1):
            prob = (h[t] if t >= 1 else 1.0) * math.prod(1 - h[i] for i in range(t + 1, gamma + 1))
            y_dist = p_dist(x) if t == gamma else _residual(p_dist(x[:t]), q_fn(x[:t]), rho[t])
            for y, py in enumerate(y_dist.tolist()):
                out[x[:t] + (y,)] += pd * prob * py
    return out


def law_sample_and_match(draft_fn: Dist, gamma: int) -> Law:
    """Drafts d_i = argmax of draft_fn; sample y_i ~ p_i, accept while y_i == d_i."""
    d: tuple[int, ...] = ()
    for _ in range(gamma):
        d += (int(draft_fn(d).argmax()),)
    out: Law = defaultdict(float)
    reach = 1.0
    for i in range(gamma):
        p = p_dist(d[:i])
        for y in range(V):
            if y != d[i]:
                out[d[:i] + (y,)] += reach * p[y].item()
        reach *= p[d[i]].item()
    for y, py in enumerate(p_dist(d).tolist()):
        out[d + (y,)] += reach * py
    return out


def completion_error(law: Law, gamma: int) -> float:
    """max |P(first gamma+1 tokens) - target joint| after completing every output with target samples."""
    worst = 0.0
    for z in itertools.product(range(V), repeat=gamma + 1):
        target = math.prod(p_dist(z[:j])[z[j]].item() for j in range(gamma + 1))
        full = sum(law.get(z[:n], 0.0) * math.prod(p_dist(z[:j])[z[j]].item() for j in range(n, gamma + 1))
                   for n in range(1, gamma + 2))
        worst = max(worst, abs(full - target))
    return worst


def mean_accepted(law: Law) -> float:
    return sum(prob * (len(s) - 1) for s, prob in law.items())


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_exact_laws_equal_target(gamma: int) -> None:
    laws = {"standard": law_standard(q_dist, gamma), "block": law_block(q_dist, gamma),
            "standard-onehot": law_standard(q_onehot, gamma), "block-onehot": law_block(q_onehot, gamma),
            "sample-and-match": law_sample_and_match(q_dist, gamma)}
    for name, law in laws.items():
        assert abs(sum(law.values()) - 1) < 1e-12, name
        assert completion_error(law, gamma) < 1e-12, name
    # acceptance: block >= token-wise on probabilistic drafts (strictly here), equal on one-hot drafts
    if gamma >= 2:
        assert mean_accepted(laws["block"]) > mean_accepted(laws["standard"]) + 1e-3
    assert abs(mean_accepted(laws["block-onehot"]) - mean_accepted(laws["standard-onehot"])) < 1e-12
    assert abs(mean_accepted(laws["sample-and-match"]) - mean_accepted(laws["standard-onehot"])) < 1e-12


def test_exact_enumeration_detects_a_wrong_residual() -> None:
    broken = law_standard(q_dist, 2, residual=lambda p, q: p)  # resample from p instead of the residual
    assert completion_error(broken, 2) > 1e-3


# ---------------------------------------------------------------- the real functions, several steps

N_TRIALS = 30000
LENGTH = 4  # tokens compared per trial: needs up to LENGTH verify steps, so keys must differ per round


def _rows_params(seed: torch.Tensor, position: torch.Tensor, temperature: float) -> RowParams:
    n = seed.shape[0]
    return RowParams(temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.int64),
                     top_p=torch.ones(n), min_p=torch.zeros(n), presence_penalty=torch.zeros(n),
                     frequency_penalty=torch.zeros(n), repetition_penalty=torch.ones(n), seed=seed,
                     position=position, suppress_eos=torch.zeros(n, dtype=torch.bool))


def simulate(method: str, drafting: str, seed_base: int = 0, q_override: str | None = None,
             length: int = LENGTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Run verify steps for N_TRIALS independent requests until each has ``length`` tokens.

    Returns (the first ``length`` tokens [N_TRIALS, length], accepted count of step 1).
    Step 1 drafts K tokens; later steps use random draft lengths 0..K (truncated blocks).
    Tensors are made on the default device (``with torch.device(...)``)."""
    n = N_TRIALS
    p_tab, q_tab = P_TAB.to(torch.get_default_device()), Q_TAB.to(torch.get_default_device())
    g = torch.Generator().manual_seed(1234 + seed_base)
    seeds = torch.arange(n, dtype=torch.int64) + 10**6 * seed_base
    seq = torch.full((n, length * (K + 1)), -1, dtype=torch.int64)
    lens = torch.zeros(n, dtype=torch.int64)
    rows = torch.arange(n)
    first_accept = None
    for step in range(length):
        c1 = torch.where(lens >= 2, seq[rows, (lens - 2).clamp(min=0)], START)
        c2 = torch.where(lens >= 1, seq[rows, (lens - 1).clamp(min=0)], START)
        a1, a2 = c1, c2
        drafts, qs = [], []
        for i in range(K):  # drafts sampled left to right: q_i depends on the drafted prefix
            logits = q_tab[a1, a2].float()
            if drafting == "greedy":
                tok = greedy_ids(logits)
            else:
                tok, q = sample_draft(logits.unsqueeze(1), _rows_params(seeds, lens + i, 1.0), lens)
                tok = tok[:, 0]
                qs.append(q[:, 0])
            drafts.append(tok)
            a1, a2 = a2, tok
        drafts_t = torch.stack(drafts, 1)
        draft_lens = torch.full((n,), K) if step == 0 else \
            torch.randint(0, K + 1, (n,), generator=g, device="cpu").to(lens.device)
        drafts_t = torch.where(torch.arange(K) < draft_lens.unsqueeze(1), drafts_t, -1)
        # target rows 0..K: row i sees the drafts before it
        t1, t2, ctx = c1, c2, []
        for i in range(K + 1):
            ctx.append((t1, t2))
            if i < K:
                t1, t2 = t2, drafts_t[:, i].clamp(min=0)
        target_logits = torch.stack([p_tab[a, b] for a, b in ctx], 1).float()
        positions = (lens.unsqueeze(1) + torch.arange(K + 1)).flatten()
        params = _rows_params(seeds.repeat_interleave(K + 1), positions, T_TARGET)
        processed = process_logits(target_logits.view(n * (K + 1), V), params).view(n, K + 1, V)
        q_probs = torch.stack(qs, 1) if qs else None
        if q_override == "uniform":
            q_probs = torch.full_like(q_probs, 1 / V)
        if method == "sample_and_match":
            a, out = verify_sample_and_match(processed, drafts_t, draft_lens, params)
        elif method == "standard":
            a, out = verify_standard(processed, q_probs, drafts_t, draft_lens, params, lens)
        else:
            a, out = verify_block(processed, q_probs, drafts_t, draft_lens, params, lens)
        assert (a >= 0).all() and (out[rows, a] >= 0).all()
        if first_accept is None:
            first_accept = a
        for j in range(K + 1):
            write = j <= a
            seq[rows[write], lens[write] + j] = out[write, j]
        lens = lens + a + 1
    assert (lens >= length).all()
    return seq[:, :length].cpu(), first_accept.cpu()


@functools.cache
def simulate_cached(method: str, drafting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """simulate() with default arguments, shared by the tests that read the same runs."""
    return simulate(method, drafting)


def joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    codes = (tokens * (V ** torch.arange(tokens.shape[1] - 1, -1, -1))).sum(1)
    return torch.bincount(codes, minlength=V ** tokens.shape[1])


def target_law() -> torch.Tensor:
    probs = torch.zeros(V**LENGTH, dtype=torch.float64)
    for z in itertools.product(range(V), repeat=LENGTH):
        code = sum(t * V ** (LENGTH - 1 - j) for j, t in enumerate(z))
        probs[code] = math.prod(p_dist(z[:j])[z[j]].item() for j in range(LENGTH))
    return probs


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value; cells expected below 5 are merged into one."""
    counts, expected = counts.double(), expected.double()
    small = expected < 5
    counts = torch.cat([counts[~small], counts[small].sum().view(1)])
    expected = torch.cat([expected[~small], expected[small].sum().view(1)])
    stat = ((counts - expected) ** 2 / expected.clamp(min=1e-300)).sum()
    df = torch.tensor(float(len(counts) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


@pytest.fixture(scope="module")
def law() -> torch.Tensor:
    return target_law()


@pytest.fixture(scope="module")
def exact_mean_accepted() -> dict[str, float]:
    return {"standard": mean_accepted(law_standard(q_dist, K)), "block": mean_accepted(law_block(q_dist, K)),
            "onehot": mean_accepted(law_standard(q_onehot, K))}


CASES = [("standard", "probabilistic", "standard"), ("block", "probabilistic", "block"),
         ("standard", "greedy", "onehot"), ("block", "greedy", "onehot"),
         ("sample_and_match", "greedy", "onehot"), ("sample_and_match", "probabilistic", None)]


@pytest.mark.parametrize("method,drafting,expected_key", CASES)
def test_verify_functions_match_target_law(method: str, drafting: str, expected_key: str | None,
                                           law: torch.Tensor, exact_mean_accepted: dict[str, float]) -> None:
    tokens, first = simulate_cached(method, drafting)
    assert chi2_pvalue(joint_counts(tokens), N_TRIALS * law) > 1e-4
    if expected_key is not None:  # step-1 accepted length agrees with the exact expectation
        se = first.double().std().item() / math.sqrt(N_TRIALS)
        assert abs(first.double().mean().item() - exact_mean_accepted[expected_key]) < 5 * se


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method,drafting", [("standard", "probabilistic"), ("block", "probabilistic"),
                                             ("sample_and_match", "greedy")])
def test_verify_functions_match_target_law_on_cuda(method: str, drafting: str, law: torch.Tensor) -> None:
    with torch.device("cuda"):
        tokens, _ = simulate(method, drafting, seed_base=5)
    assert chi2_pvalue(joint_counts(tokens), N_TRIALS * law) > 1e-4


def test_block_accepts_more_than_standard_on_sampled_drafts() -> None:
    _, standard = simulate_cached("standard", "probabilistic")
    _, block = simulate_cached("block", "probabilistic")
    diff = block.double().mean() - standard.double().mean()
    se = math.sqrt((block.double().var() + standard.double().var()).item() / N_TRIALS)
    assert diff > 5 * se


def test_negative_control_wrong_q_fails(law: torch.Tensor) -> None:
    # the verifier is told q is uniform while the drafts came from the draft table. (Claiming
    # one-hot q would not do: conditioned on the drafted token that rule is sample-and-match,
    # which is lossless for any drafter.)
    tokens, _ = simulate("standard", "probabilistic", q_override="uniform")
    assert chi2_pvalue(joint_counts(tokens), N_TRIALS * law) < 1e-9


def test_negative_control_residual_replaced_by_p_fails(law: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "_residual_scores", lambda log_p, *args: log_p)
    tokens, _ = simulate("standard", "probabilistic")
    assert chi2_pvalue(joint_counts(tokens), N_TRIALS * law) < 1e-9


def test_negative_control_block_without_residual_mass_fails(law: torch.Tensor,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "_residual_mass", lambda target, q, drafts, rho, *args: torch.zeros_like(rho))
    tokens, _ = simulate("block", "probabilistic")
    assert chi2_pvalue(joint_counts(tokens), N_TRIALS * law) < 1e-9


# ---------------------------------------------------------------- deterministic behaviour


def _params(n: int, temperature: float | list[float], **kw) -> RowParams:
    temps = temperature if isinstance(temperature, list) else [temperature] * n
    kw.setdefault("seed", [5] * n)
    kw.setdefault("position", list(range(n)))
    return RowParams.from_host(temperature=temps, **kw)


ALL_RULES = ["greedy", "sample_and_match", "standard", "block"]


def _run(rule: str, processed: torch.Tensor, drafts: torch.Tensor, lens: torch.Tensor, p: RowParams,
         q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    rnd = torch.arange(drafts.shape[0])
    if rule == "greedy":
        return verify_greedy(processed, drafts, lens)
    if rule == "sample_and_match":
        return verify_sample_and_match(processed, drafts, lens, p)
    fn = verify_standard if rule == "standard" else verify_block
    return fn(processed, q, drafts, lens, p, rnd)


@pytest.mark.parametrize("rule", ALL_RULES)
def test_greedy_requests_follow_argmax(rule: str) -> None:
    logits = torch.tensor([[[0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 2, 1], [1, 0, 0, 0]],
                           [[0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 2, 1], [1, 0, 0, 0]],
                           [[0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 2, 1], [1, 0, 0, 0]],
                           [[0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 2, 1], [1, 0, 0, 0]],
                           [[0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 2, 1], [1, 0, 0, 0]]], dtype=torch.float32)
    drafts = torch.tensor([[1, 0, 2], [1, 3, 2], [1, 0, 9], [2, -1, -1], [1, 0, 2]])
    lens = torch.tensor([3, 3, 3, 1, 0])
    p = _params(5 * 4, 0.0)
    a, out = _run(rule, process_logits(logits.view(20, 4), p).view(5, 4, 4), drafts, lens, p)
    assert a.tolist() == [3, 1, 2, 0, 0]
    assert out.tolist() == [[1, 0, 2, 0], [1, 0, -1, -1], [1, 0, 2, -1], [1, -1, -1, -1], [1, -1, -1, -1]]
    # an id outside the vocabulary ends the draft (request 2), like the end of the block


@pytest.mark.parametrize("k", [0, 1, 7, 15])  # 0: every draft pruned
@pytest.mark.parametrize("vocab", [50, None])
def test_the_cpus_host_loop_gives_the_torch_rules_counts_and_tokens(k: int, vocab: int | None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance by match on the CPU reads the rows out and loops over ints: the same counts and tokens as
    the torch rule on every case the rule distinguishes, and the path `verify_greedy` takes there."""
    ids, drafts, lens = acceptance_cases(k, 64, k, 50)
    want = verify_mod._verify_ids(ids, drafts, verify_mod._draft_lengths(drafts, lens, vocab))
    a, out = want
    assert (a == 0).any() and (a == lens).any() and (out[:, 0] == -1).any()
    assert k <= 1 or ((a > 0) & (a < lens)).any()
    monkeypatch.setattr(verify_mod, "_verify_ids", None)  # the torch rule is not what the CPU runs
    got = verify_greedy(ids, drafts, lens) if vocab is None else verify_mod.accept_matching(ids, drafts, lens, vocab)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # negative control: one request's first row no longer matching its draft is seen
    row = int(torch.nonzero(a >= 2)[0, 0]) if k > 1 else None
    if row is not None:
        ids[row, 0] = (drafts[row, 0] + 1) % 50
        got = verify_mod._accept_on_host(ids, drafts, lens, vocab)
        assert got[0][row] == 0 and got[1][row].tolist() == [int(ids[row, 0])] + [-1] * k


@pytest.mark.parametrize("rule", ALL_RULES)
def test_a_bad_row_fails_its_request_where_its_next_token_comes_from_it(rule: str) -> None:
    """The row a request's next token comes from (its first rejected draft's, or the bonus row) being bad
    fails the request alone, there: its accepted drafts come first, as plain decoding commits them before it
    reads that row (one of them may stop the request, so the bad row is never read); a bad row past a rejected
    draft follows drafts plain decoding never takes (a grammar's mask after a draft that ends it is one), and
    fails nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, K + 1, 6, generator=g)
    drafts = torch.tensor([[1, 2, 3], [0, 2, 3], [4, 4, 4], [5, -1, -1], [1, 2, 3]])
    for r, tokens in ((1, [5, 2, 3]), (2, [4, 4, 4]), (4, [1, 2, 3])):  # rows that prefer these tokens
        for i, t in enumerate(tokens):
            logits[r, i, t] = 30.0
    logits[0, 0] = float("-inf")  # request 0: its first row, which it samples from, has no token
    logits[1, 0, 0] = -30.0  # request 1 drafts 0 where its row wants 5: rejected at row 0 ...
    logits[1, 2, 1] = float("nan")  # ... so its bad row 2 is never read
    logits[2, 3, 0] = float("inf")  # request 2: every draft accepted, the bonus row is bad
    logits[3, 3, 0] = float("nan")  # request 3 drafts only 1: row 3 is not one of its rows
    logits[4, 2, 0] = float("nan")  # request 4 accepts drafts 0 and 1 and samples from its bad row 2
    lens = torch.tensor([3, 3, 3, 1, 3])
    p = _params(5 * (K + 1), 0.0 if rule == "greedy" else 0.8)
    processed = process_logits(logits.view(-1, 6), p).view(5, K + 1, 6)
    q = torch.softmax(torch.randn(5, K, 6, generator=g), -1) if rule in ("standard", "block") else None
    a, out = _run(rule, processed, drafts, lens, p, q)
    for r, accepted in ((0, 0), (2, 3), (4, 2)):  # the accepted drafts, then -1 where the bad row is read
        assert a[r].item() == accepted, r
        assert out[r].tolist() == drafts[r, :accepted].tolist() + [-1] * (K + 1 - accepted), r
    assert a[1].item() == 0 and 0 <= out[1, 0].item() < 6 and (out[1, 1:] == -1).all()
    assert 0 <= out[3, a[3]].item() < 6


def test_frequency_penalty_rejects_repeated_draft_at_the_right_index() -> None:
    # token 3 leads by 1.5 at every row; with frequency penalty 1.0 each earlier 3 costs 1.0, so
    # rows 0 and 1 still pick 3 and row 2 (two 3s before it) picks token 0
    vocab, k = 5, 3
    row = torch.tensor([1.0, -2.0, -2.0, 2.5, -2.0])
    logits = row.expand(1, k + 1, vocab).clone()
    drafts = torch.tensor([[3, 3, 3]])
    lens = torch.tensor([3])
    req_counts = torch.zeros(1, vocab, dtype=torch.int32)
    offsets = torch.arange(k + 1)
    with_block = expand_history(req_counts, torch.zeros(k + 1, dtype=torch.int64), drafts, offsets)
    no_block = req_counts.expand(k + 1, vocab).clone()
    for temperature in (0.0, 0.05):
        results = []
        for counts in (with_block, no_block):
            p = _params(k + 1, temperature, frequency_penalty=[1.0] * (k + 1), output_counts=counts)
            processed = process_logits(logits.view(k + 1, vocab), p).view(1, k + 1, vocab)
            if temperature == 0:
                results.append(verify_greedy(processed, drafts, lens))
            else:
                results.append(verify_sample_and_match(processed, drafts, lens, p))
                assert torch.equal(verify_standard(processed, None, drafts, lens, p, torch.zeros(1))[1],
                                   results[-1][1])
        (a, out), (a_no, out_no) = results
        assert a.item() == 2 and out[0].tolist() == [3, 3, 0, -1]
        assert a_no.item() == 3 and out_no[0].tolist() == [3, 3, 3, 3]  # without the block history: accepted


@pytest.mark.parametrize("rule", ["standard", "block"])
def test_round_key_changes_acceptance_noise(rule: str) -> None:
    g = torch.Generator().manual_seed(5)
    n = 2000
    processed = torch.log_softmax(torch.randn(n, K + 1, 5, generator=g), -1)
    drafts = torch.randint(0, 5, (n, K), generator=g)
    lens = torch.full((n,), K)
    p = _params(n * (K + 1), 1.0)
    fn = verify_standard if rule == "standard" else verify_block
    a1, o1 = fn(processed, None, drafts, lens, p, torch.zeros(n, dtype=torch.int64))
    a2, o2 = fn(processed, None, drafts, lens, p, torch.zeros(n, dtype=torch.int64))
    a3, _ = fn(processed, None, drafts, lens, p, torch.ones(n, dtype=torch.int64))
    assert torch.equal(a1, a2) and torch.equal(o1, o2)
    assert (a1 != a3).any()


def test_chunked_equals_unchunked() -> None:
    g = torch.Generator().manual_seed(9)
    n, vocab = 33, 40
    processed = torch.log_softmax(torch.randn(n, K + 1, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(n, K, vocab, generator=g), -1)
    drafts = torch.randint(0, vocab, (n, K), generator=g)
    lens = torch.randint(0, K + 1, (n,), generator=g)
    p = _params(n * (K + 1), 0.9)
    rnd = torch.arange(n)
    for fn in (verify_standard, verify_block):
        for qq in (q, None):
            full = fn(processed, qq, drafts, lens, p, rnd)
            small = fn(processed, qq, drafts, lens, p, rnd, chunk_elems=vocab * K * 2)
            assert torch.equal(full[0], small[0]) and torch.equal(full[1], small[1])


def test_bonus_is_the_plain_target_sample_at_its_position() -> None:
    # with no drafts every rule emits only the bonus row: drawn with STREAM_TARGET noise keyed by
    # (seed, position), it is exactly the token plain sampling draws there
    g = torch.Generator().manual_seed(2)
    n = 64
    processed = torch.log_softmax(torch.randn(n, 1, 30, generator=g), -1)
    p = _params(n, [0.0, 0.8, 1.0, 1.4] * (n // 4), seed=list(range(n)), position=[17 + i for i in range(n)])
    plain = sample_processed(processed.view(n, 30), p)
    none = torch.zeros(n, 0, dtype=torch.int64)
    zero = torch.zeros(n, dtype=torch.int64)
    for rule in ALL_RULES:
        a, out = _run(rule, processed, none, zero, p, torch.zeros(n, 0, 30))
        assert (a == 0).all() and torch.equal(out[:, 0], plain if rule != "greedy" else processed[:, 0].argmax(-1))


def test_sample_and_match_on_the_cpu_samples_only_the_rows_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU rows are sampled in position order while each request's drafts match: the same counts and
    tokens as sampling every row, a bad row failing its request where it is read (not past a mismatch),
    with fewer rows drawn; a sampler keyed otherwise is seen."""
    r, k, vocab = 24, 7, 40
    g = torch.Generator().manual_seed(3)
    temps = [0.0 if q % 5 == 0 else 0.9 for q in range(r) for _ in range(k + 1)]  # every fifth request greedy
    p = _params(r * (k + 1), temps, seed=[q for q in range(r) for _ in range(k + 1)],
                position=[100 + i for _ in range(r) for i in range(k + 1)])
    logits = torch.randn(r, k + 1, vocab, generator=g) * 3
    logits[1, 5] = float("nan")  # request 1's sixth row, reached by its matching drafts
    logits[2, 0, 3] = float("inf")  # request 2's first row
    processed = process_logits(logits.view(-1, vocab), p).view(r, k + 1, vocab)
    every = sample_processed(processed.view(-1, vocab), p).view(r, k + 1)
    # drafts: each request's sampled tokens for a prefix of its own length, then a wrong one
    cut = torch.randint(0, k + 1, (r,), generator=g)
    cut[1] = 6  # request 1 matches through its bad row
    cut[3] = 2  # request 3 mismatches before its bad row, which it never reads
    logits_bad = processed.clone()
    logits_bad[3, 5] = float("nan")
    drafts = torch.where(torch.arange(k)[None, :] < cut[:, None], every[:, :k], (every[:, :k] + 1) % vocab)
    lens = torch.full((r,), k)
    want = verify_mod.accept_matching(sample_processed(logits_bad.view(-1, vocab), p).view(r, k + 1), drafts, lens,
                                      vocab)
    drawn = []
    real = verify_mod.gumbel_argmax
    monkeypatch.setattr(verify_mod, "gumbel_argmax", lambda rows, keys: drawn.append(len(rows)) or real(rows, keys))
    got = verify_sample_and_match(logits_bad, drafts, lens, p)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0][1] == 5 and got[1][1].tolist() == drafts[1, :5].tolist() + [-1] * 3  # a bad row read fails its
    assert got[0][2] == 0 and (got[1][2] == -1).all()  # request there, after its accepted drafts (1, 2)
    assert got[0][3] == 2 and (got[1][3][:3] >= 0).all()  # one past its mismatch fails nothing (3)
    assert ((got[0] > 0) & (got[0] < k)).any() and (got[0] == k).any()
    assert sum(drawn) < 0.6 * sum(t > 0 for t in temps)
    monkeypatch.setattr(verify_mod, "STREAM_TARGET", verify_mod.STREAM_TARGET + 1)  # negative control
    assert not torch.equal(verify_sample_and_match(logits_bad, drafts, lens, p)[1], want[1])
