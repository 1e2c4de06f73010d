"""Target forwards for the engine: packs requests' token runs into one padded batch on the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from blockspec.engine.kv_cache import KVCache, causal_meta
from blockspec.models.llama import CausalLM


class ModelRunner:
    """Owns the target model and its KV cache; every forward is `tokens at positions -> hidden (+ taps)`."""

    def __init__(self, model: CausalLM, max_slots: int, max_len: int, taps: Sequence[int] = ()) -> None:
        self.model = model
        self.device = model.embed_tokens.weight.device
        self.cache: KVCache = model.new_cache(max_slots, max_len, self.device)
        self.taps = tuple(taps)

    def forward(
        self, runs: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int], with_taps: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """runs[r] are token ids fed at positions starts[r], ...; returns hidden [R, Q, H], taps [R, Q, F]."""
        q = max(len(r) for r in runs)
        ids = torch.zeros(len(runs), q, dtype=torch.int64)
        for i, run in enumerate(runs):
            ids[i, : len(run)] = torch.as_tensor(run, dtype=torch.int64)
        return self.forward_ids(ids.to(self.device, non_blocking=True), [len(r) for r in runs], starts, slots,
                                with_taps)

    def forward_ids(
        self, ids: Tensor, q_lens: Sequence[int], starts: Sequence[int], slots: Sequence[int], with_taps: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """Same as `forward` with the ids already a padded device tensor [R, Q] (e.g. drafts + anchors)."""
        cfg = self.model.config
        meta = causal_meta(list(slots), list(starts), list(q_lens), ids.shape[1], self.cache.trash, self.device,
                           cfg.sliding_window, cfg.layer_types)
        return self.model(ids, meta, self.cache, self.taps if with_taps else ())

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)

    def greedy_ids(self, hidden: Tensor, chunk_rows: int = 64) -> Tensor:
        """Argmax token per row without holding more than `chunk_rows` vocabulary rows at once."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
        for i in range(0, flat.shape[0], chunk_rows):
            out[i : i + chunk_rows] = self.model.compute_logits(flat[i : i + chunk_rows]).argmax(-1)
        return out.view(hidden.shape[:-1])
