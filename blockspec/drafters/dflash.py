"""DFlash (z-lab ``DFlashDraftModel``, speculators ``dflash``): the backbone, whose block rows 1..B-1
propose independent drafts."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from blockspec.drafters.backbone import DraftModel
from blockspec.sample import RowParams


class DFlashDraft(DraftModel):
    """DFlash drafter: every draft position is decided at once, given the context."""

    def greedy_drafts(self, slot_hidden: Tensor, anchors: Tensor, top_k: int = 0,
                      head_argmax: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, None]:
        if head_argmax is not None and self.plain_target_head:
            return head_argmax(slot_hidden), None
        return self.draft_to_target(self.logits(slot_hidden).max(-1).indices), None  # argmax, 2-3x faster on the CPU

    def sample_drafts(self, slot_hidden: Tensor, anchors: Tensor, params: RowParams, round_: Tensor, vocab: int,
                      top_k: int = 0) -> tuple[Tensor, Tensor, None]:
        return self._sample_independent(slot_hidden, params, round_, vocab)
