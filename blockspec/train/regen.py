"""Regeneration: the target's own continuations of corpus prompts, as token pieces for drafter training.

Prompts are cut on the CPU from the corpus's train pieces (`make_prompts`): each starts at a line
start and holds no document end. A GPU slice (`regen_slice`) continues them with blockspec's engine
in large batches, prompt i at temperatures[i % len(temperatures)] (greedy and T = 0.7 in turn) with
a per-prompt seed, and writes its rows as pieces ``regen-NNNNN.u16.xz`` in the corpus's format: rows
of prompt_tokens + new_tokens tokens, a continuation padded after its EOS or its last token. The
state (``regen_state.json``: the next prompt, the pieces and tokens so far) makes slices continue
where the last one stopped, the pieces' indices and offsets following on, so `corpus.load_split`
reads all slices' pieces as one split.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from blockspec.train.corpus import (
    MIB,
    compress_tokens,
    load_piece,
    write_piece,
)
from blockspec.train.data import DataError
from blockspec.train.stream import REGEN_SPLIT, Rows, load_rows

PROMPT_SPLIT = "prompts"
STATE_FILE = "regen_state.json"


# ---------------------------------------------------------------- prompts (CPU)
def newline_ids(tokenizer: Any) -> np.ndarray:
    """Ids of the tokens whose text holds a newline: the token after one starts a line."""
    return np.array([i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i])], dtype=np.int64)


def prompt_starts(tokens: np.ndarray, prompt_tokens: int, eos_id: int, newlines: np.ndarray) -> np.ndarray:
    """Positions s where a line starts (tokens[s - 1] holds a newline) and tokens[s : s + prompt_tokens] hold
    no EOS."""
    n = len(tokens) - prompt_tokens
    if n <= 1:
        return np.zeros(0, dtype=np.int64)
    eos = np.concatenate([[0], np.cumsum(tokens == eos_id)])
    starts = np.arange(1, n + 1)
    clean = eos[starts + prompt_tokens] - eos[starts] == 0
    after_newline = np.isin(tokens[starts - 1], newlines)
    return starts[clean & after_newline]


def make_prompts(piece_paths: list[Path], tokenizer: Any, count: int, prompt_tokens: int, seed: int,
                 out: Path, tokenizer_sha256: str = "") -> dict[str, Any]:
    """`count` prompts drawn evenly over the pieces (in proportion to their sizes), in a seeded order,
    written to `out` as the piece ``prompts-00000.u16.xz``; returns its sidecar."""
    rng = np.random.default_rng(seed)
    newlines = newline_ids(tokenizer)
    sizes = [json.loads(p.with_name(p.name.removesuffix(".u16.xz") + ".json").read_text())["tokens"]
             for p in piece_paths]
    quota = np.floor(np.array(sizes) / sum(sizes) * count).astype(int)
    quota[: count - quota.sum()] += 1
    rows = []
    for path, want in zip(piece_paths, quota):
        tokens = load_piece(path)
        starts = prompt_starts(tokens, prompt_tokens, tokenizer.eos_token_id, newlines)
        if len(starts) < want:
            raise DataError(f"{path}: {len(starts)} prompt starts, {want} wanted")
        chosen = np.sort(rng.choice(starts, size=want, replace=False))
        rows.append(np.stack([tokens[s : s + prompt_tokens] for s in chosen]))
    prompts = np.concatenate(rows)[rng.permutation(count)]
    out.mkdir(parents=True, exist_ok=True)
    return write_piece(out, PROMPT_SPLIT, 0, 0, prompts.reshape(-1), tokenizer.eos_token_id, len(tokenizer),
                       tokenizer_sha256, extra={"row_tokens": prompt_tokens, "prompt_tokens": prompt_tokens,
                                                "pad_id": tokenizer.pad_token_id, "seed": seed,
                                                "sources": [p.name for p in piece_paths]})


# ---------------------------------------------------------------- regeneration (GPU)
@dataclass
class RegenConfig:
    """How the continuations are made; fixed by the first slice (later slices take the state's)."""

    new_tokens: int = 448
    temperatures: tuple[float, ...] = (0.0, 0.7)
    batch_size: int = 256
    chunk_prompts: int = 2048
    max_piece_bytes: int = 15 * MIB  # a returned file holds at most 16 MiB
    xz_preset: int = 1  # 11 MB/s of tokens on one core, 0.61 bytes a token on code (preset 6: 2.5 MB/s, 0.52)
    seed: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegenConfig:
        return cls(**{**d, "temperatures": tuple(d["temperatures"])})


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's weights, tensor by tensor in name order: which model made the rows, the same
    for its one-file and its sharded export."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}\t{t.dtype}\t{list(t.shape)}\n".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_regen_state(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text())


def continuation_rows(prompts: np.ndarray, outputs: list[list[int]], new_tokens: int, pad_id: int) -> np.ndarray:
    """[n, P + new_tokens] rows: each prompt, its continuation (cut to new_tokens), pad after it."""
    rows = np.full((len(prompts), prompts.shape[1] + new_tokens), pad_id, dtype=np.uint16)
    rows[:, : prompts.shape[1]] = prompts
    for row, gen in zip(rows, outputs):
        gen = gen[:new_tokens]
        row[prompts.shape[1] : prompts.shape[1] + len(gen)] = gen
    return rows


def row_pieces(rows: np.ndarray, max_bytes: int, preset: int) -> list[tuple[np.ndarray, bytes]]:
    """Whole rows in as few pieces as keep each under max_bytes compressed, with their xz bytes; the number
    of pieces comes from the first million tokens' compression ratio, and grows if a piece comes out over."""
    sample = rows.reshape(-1)[: 1 << 20]
    per_token = len(compress_tokens(sample, preset)) / max(1, len(sample))
    parts = max(1, math.ceil(rows.size * per_token / (0.9 * max_bytes)))
    while True:
        chunks = np.array_split(rows, min(parts, len(rows)))
        blobs = [compress_tokens(c.reshape(-1), preset) for c in chunks]
        if all(len(b) <= max_bytes for b in blobs) or parts >= len(rows):
            return list(zip(chunks, blobs))
        parts = max(parts + 1, math.ceil(parts * max(map(len, blobs)) / (0.9 * max_bytes)))


def repeated_line_share(texts: list[str]) -> float:
    """Share of non-blank lines that repeat an earlier non-blank line of the same text (the issue's
    plausibility measure on greedy continuations)."""
    lines = repeats = 0
    for text in texts:
        seen: set[str] = set()
        for line in text.split("\n"):
            norm = line.strip()
            if not norm:
                continue
            lines += 1
            repeats += norm in seen
            seen.add(norm)
    return repeats / max(1, lines)


def regen_slice(target_dir: Path, prompts_dir: Path, out_dir: Path, *, state_path: Path | None = None,
                cfg: RegenConfig | None = None, minutes: float | None = None, max_prompts: int | None = None,
                device: str = "auto") -> dict[str, Any]:
    """Continue prompts from the state's next one until the time or prompt budget (or the prompts) run out;
    write this slice's pieces and the new state (regen_state.json) to `out_dir`. Returns the slice's metrics."""
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    t0 = time.monotonic()
    prompts = load_rows(prompts_dir, PROMPT_SPLIT)
    prompt_meta = json.loads((prompts_dir / f"{PROMPT_SPLIT}-00000.json").read_text())
    state = read_regen_state(state_path or out_dir / STATE_FILE)
    fingerprint = target_fingerprint(target_dir)
    if state is None:
        cfg = cfg or RegenConfig()
        state = {"config": asdict(cfg), "target": fingerprint, "prompts_sha256": prompt_meta["sha256"],
                 "next_prompt": 0, "pieces": 0, "tokens": 0, "rows": 0, "generated_tokens": 0, "history": []}
    else:
        cfg = RegenConfig.from_dict(state["config"])
        for key, now in (("target", fingerprint), ("prompts_sha256", prompt_meta["sha256"])):
            if state[key] != now:
                raise DataError(f"{state_path or out_dir / STATE_FILE}: the state's {key} differs from this slice's: "
                                "its rows came from another target or prompt set")
    width = prompts.tokens.shape[1] + cfg.new_tokens
    llm = LLM(str(target_dir), device=device, seed=cfg.seed, max_num_seqs=cfg.batch_size, max_model_len=width + 1)
    pad_id = prompts.pad_id
    first = state["next_prompt"]
    stop = len(prompts.tokens) if max_prompts is None else min(len(prompts.tokens), first + max_prompts)
    rows: list[np.ndarray] = []
    greedy_texts: list[str] = []
    i = first
    t_gen = time.monotonic()
    while i < stop and (minutes is None or time.monotonic() - t0 < minutes * 60):
        j = min(stop, i + cfg.chunk_prompts)
        batch = prompts.tokens[i:j]
        # token ids only: the engine's per-token text decoding of 512 requests is host time a step spends for
        # nothing (the few greedy texts the metrics need are decoded below)
        params = [SamplingParams(temperature=cfg.temperatures[k % len(cfg.temperatures)], max_tokens=cfg.new_tokens,
                                 seed=cfg.seed * 1_000_003 + k, detokenize=False) for k in range(i, j)]
        outs = llm.generate([{"prompt_token_ids": p.tolist()} for p in batch], params, use_tqdm=False)
        gens = [list(o.outputs[0].token_ids) for o in outs]
        rows.append(continuation_rows(batch, gens, cfg.new_tokens, pad_id))
        if llm.tokenizer is not None and len(greedy_texts) < 256:
            greedy_texts += [llm.tokenizer.decode(g[:96]) for k, g in zip(range(i, j), gens)
                             if cfg.temperatures[k % len(cfg.temperatures)] == 0.0][: 256 - len(greedy_texts)]
        i = j
    gen_seconds = time.monotonic() - t_gen
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if rows:
        block = np.concatenate(rows)
        start = first
        for part, blob in row_pieces(block, cfg.max_piece_bytes, cfg.xz_preset):
            sidecar = write_piece(out_dir, REGEN_SPLIT, state["pieces"], state["tokens"], part.reshape(-1),
                                  prompt_meta["eos_id"], prompt_meta["vocab_size"], prompt_meta["tokenizer_sha256"],
                                  blob=blob, extra={"row_tokens": width, "prompt_tokens": prompts.tokens.shape[1],
                                                    "pad_id": pad_id, "first_prompt": start,
                                                    "temperatures": list(cfg.temperatures), "target": fingerprint})
            written.append(sidecar["file"])
            state["pieces"] += 1
            state["tokens"] += part.size
            start += len(part)
        lengths = Rows(block, prompts.tokens.shape[1], pad_id).continuation_lengths()
    else:
        lengths = np.zeros(0, dtype=np.int64)
    state["next_prompt"] = i
    state["rows"] += len(lengths)
    state["generated_tokens"] += int(lengths.sum())
    result = {"prompts": [first, i], "rows": len(lengths), "generated_tokens": int(lengths.sum()),
              "generation_seconds": round(gen_seconds, 1),
              "generated_tokens_per_s": round(float(lengths.sum()) / gen_seconds) if gen_seconds > 0 else None,
              "full_length_share": round(float((lengths == cfg.new_tokens).mean()), 3) if len(lengths) else None,
              "greedy_repeated_line_share_96": round(repeated_line_share(greedy_texts), 3) if greedy_texts else None,
              "pieces": written, "total_generated_tokens": state["generated_tokens"],
              "prompts_left": len(prompts.tokens) - i}
    state["history"].append(result)
    tmp = out_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    tmp.replace(out_dir / STATE_FILE)
    return result
