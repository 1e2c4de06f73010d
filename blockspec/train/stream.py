"""Training batches streamed from token pieces, with positions small enough to travel in a state file.

Pretraining reads the corpus's train pieces one at a time (a GPU call carries about one piece), as
windows of seq_len + 1 tokens in a seeded order per (epoch, piece); its position is (epoch, piece,
batch). Drafter training reads regenerated pieces of fixed-length rows (prompt + continuation)
whole, in seeded epochs; its position is (epoch, pos), as `data.Batches`. Either gives the same
batches after a resume as without one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from blockspec.train.corpus import PIECE_SUFFIX, load_piece, load_split, sidecar_name
from blockspec.train.data import DataError, Example, ShuffledEpochs

REGEN_SPLIT = "regen"


class PieceMissing(DataError):
    """The next batch needs a piece that is not in the pieces directory; `file` names it (carry it next)."""

    def __init__(self, file: str, pieces_dir: Path) -> None:
        super().__init__(f"{pieces_dir}: piece {file} is needed next and is not here")
        self.file = file


@dataclass(frozen=True)
class PieceInfo:
    """A piece of the plan: its file name and token count (from the corpus manifest)."""

    file: str
    tokens: int


def manifest_plan(manifest_path: str | Path, split: str = "train") -> list[PieceInfo]:
    """The pieces of `split` in the corpus manifest, in order."""
    try:
        manifest = json.loads(Path(manifest_path).read_text())
        pieces = manifest["splits"][split]["pieces"]
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise DataError(f"{manifest_path}: cannot read the {split} pieces of the corpus manifest: {exc}") from None
    return [PieceInfo(p["file"], int(p["tokens"])) for p in pieces]


def piece_windows(tokens: np.ndarray, seq_len: int, count: int | None = None) -> np.ndarray:
    """Windows of seq_len + 1 tokens starting every seq_len tokens ([n, seq_len + 1]); `count` of them spread
    evenly over the piece when given."""
    n = (len(tokens) - 1) // seq_len
    starts = np.arange(n) * seq_len
    if count is not None and count < n:
        starts = starts[np.linspace(0, n - 1, count).round().astype(np.int64)]
    return np.stack([tokens[s : s + seq_len + 1] for s in starts]) if len(starts) else np.zeros((0, seq_len + 1),
                                                                                               np.uint16)


def window_examples(tokens: np.ndarray, seq_len: int, count: int) -> list[Example]:
    """`count` evaluation windows spread over `tokens`, every token a target."""
    return [Example(w.astype(np.int64).tolist(), [1] * (seq_len + 1)) for w in piece_windows(tokens, seq_len, count)]


class WindowBatches:
    """Pretraining batches [batch_size, seq_len + 1] over the plan's pieces, epoch after epoch.

    Within a piece the windows come in a permutation seeded by (seed, epoch, piece); the ragged tail
    of fewer than batch_size windows is dropped (static shapes). Only the current piece is in memory.
    """

    def __init__(self, plan: list[PieceInfo], pieces_dir: str | Path, seq_len: int, batch_size: int,
                 seed: int) -> None:
        if not plan:
            raise DataError("no training pieces in the plan")
        self.plan = plan
        self.pieces_dir = Path(pieces_dir)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = self.piece = self.batch = 0
        self._loaded: tuple[int, np.ndarray] | None = None
        self._perm: tuple[tuple[int, int], Tensor] | None = None
        if self.steps_per_epoch == 0:
            raise DataError(f"the pieces hold no batch of {batch_size} windows of {seq_len + 1} tokens")

    def windows(self, piece: int) -> int:
        return (self.plan[piece].tokens - 1) // self.seq_len

    def batches_in(self, piece: int) -> int:
        return self.windows(piece) // self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        return sum(self.batches_in(i) for i in range(len(self.plan)))

    def _advance(self) -> None:
        """Skip to the next piece (and epoch) while the current one has no batch left."""
        while self.batch >= self.batches_in(self.piece):
            self.batch = 0
            self.piece += 1
            if self.piece == len(self.plan):
                self.piece = 0
                self.epoch += 1

    def needed(self) -> str:
        """The file of the piece the next batch comes from."""
        self._advance()
        return self.plan[self.piece].file

    def available(self) -> bool:
        """Whether the piece the next batch needs is in the pieces directory."""
        return (self.pieces_dir / self.needed()).is_file()

    def _tokens(self) -> np.ndarray:
        if self._loaded is None or self._loaded[0] != self.piece:
            self._loaded = None  # free the last piece before reading the next
            info = self.plan[self.piece]
            path = self.pieces_dir / info.file
            if not path.is_file():
                raise PieceMissing(info.file, self.pieces_dir)
            tokens = load_piece(path)
            if len(tokens) != info.tokens:
                raise DataError(f"{path}: {len(tokens)} tokens, the plan says {info.tokens}")
            self._loaded = (self.piece, tokens)
        return self._loaded[1]

    def _order(self) -> Tensor:
        key = (self.epoch, self.piece)
        if self._perm is None or self._perm[0] != key:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + self.piece)
            self._perm = (key, torch.randperm(self.windows(self.piece), generator=g))
        return self._perm[1]

    def __iter__(self) -> WindowBatches:
        return self

    def __next__(self) -> Tensor:
        self._advance()
        tokens = self._tokens()
        idx = self._order()[self.batch * self.batch_size : (self.batch + 1) * self.batch_size].numpy()
        starts = idx * self.seq_len
        rows = np.stack([tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)
        self.batch += 1
        return torch.from_numpy(rows)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "piece": self.piece, "batch": self.batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.piece, self.batch = int(state["epoch"]), int(state["piece"]), int(state["batch"])


# ---------------------------------------------------------------- regenerated rows
@dataclass
class Rows:
    """Fixed-length rows [n, prompt_tokens + new_tokens] of prompts and the target's continuations.

    A continuation ends before its first pad token (rows are padded after an EOS or at max_tokens).
    """

    tokens: np.ndarray
    prompt_tokens: int
    pad_id: int

    def continuation_lengths(self) -> np.ndarray:
        cont = self.tokens[:, self.prompt_tokens :] == self.pad_id
        return np.where(cont.any(1), cont.argmax(1), cont.shape[1])

    def loss_mask(self) -> np.ndarray:
        """1 on the continuation's tokens, 0 on the prompt and the padding."""
        width = self.tokens.shape[1] - self.prompt_tokens
        cont = np.arange(width)[None, :] < self.continuation_lengths()[:, None]
        return np.concatenate([np.zeros((len(self.tokens), self.prompt_tokens), bool), cont], axis=1)


def row_layout(pieces_dir: str | Path, split: str = REGEN_SPLIT) -> dict[str, Any]:
    """The row layout of a split's first piece's sidecar (row_tokens, prompt_tokens, pad_id)."""
    names = sorted(Path(pieces_dir).glob(f"{split}-*{PIECE_SUFFIX}"))
    if not names:
        raise DataError(f"{pieces_dir}: no pieces of split '{split}'")
    meta = json.loads(names[0].with_name(sidecar_name(names[0].name)).read_text())
    if "row_tokens" not in meta:
        raise DataError(f"{names[0]}: not a piece of fixed-length rows (no row_tokens in its sidecar)")
    return meta


def load_rows(pieces_dir: str | Path, split: str = REGEN_SPLIT) -> Rows:
    """Every piece of `split`, verified, as rows."""
    meta = row_layout(pieces_dir, split)
    tokens = load_split(pieces_dir, split)
    width = int(meta["row_tokens"])
    if len(tokens) % width:
        raise DataError(f"{pieces_dir}: {len(tokens)} tokens are not whole rows of {width}")
    return Rows(tokens.reshape(-1, width), int(meta["prompt_tokens"]), int(meta["pad_id"]))


class RowBatches(ShuffledEpochs):
    """(ids, loss_mask) batches of regenerated rows, in data.Batches' epochs and state_dict."""

    def __init__(self, rows: Rows, batch_size: int, seed: int) -> None:
        if len(rows.tokens) < 1:
            raise DataError("no regenerated rows")
        self.tokens = rows.tokens
        self.mask = rows.loss_mask()
        super().__init__(len(rows.tokens), batch_size, seed)

    def __next__(self) -> tuple[Tensor, Tensor]:
        idx = np.sort(np.asarray(self.next_indices()))
        return (torch.from_numpy(self.tokens[idx].astype(np.int64)), torch.from_numpy(self.mask[idx].astype(np.int64)))
