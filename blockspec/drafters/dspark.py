"""DSpark: the shared backbone (anchor-first) plus the sequential Markov head and the confidence head.

Formulas (DeepSpec ``deepspec/modeling/dspark/markov_head.py`` and ``common.py``; speculators
``models/dspark/model_definitions.py`` computes the same with a draft-vocabulary W2):

* Markov bias at draft position k, previous token x_{k-1} (x_0 = anchor, a TARGET-vocab id),
  e = W1[x_{k-1}] (``markov_w1``, an embedding over the target vocabulary):
    - vanilla: B_k = W2 e
    - gated:   g = sigmoid(gate_proj([h_k ; e])),  B_k = W2 (g * e)
    - rnn:     [g; c; o] = joint_proj([s_{k-1} ; e ; h_k]),  s_k = sig(g) s_{k-1} + (1 - sig(g)) tanh(c),
               B_k = W2 tanh(o),  s_0 = 0
  ``markov_w2`` maps rank r to the draft vocabulary (the target's, or a reduced one with ``d2t``).
* Draft distribution: p_k = softmax(U_k + B_k), U_k = lm_head(h_k); drafted left to right.
* Confidence: c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b) (h_k only without ``confidence_head_with_markov``).

``markov_step`` and ``confidence`` are the single source of these formulas; ``draft_greedy`` and the
engine's sampled path both call them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from blockspec.config import ConfigError, ModelConfig
from blockspec.drafters.backbone import DraftModel
from blockspec.drafters.config import DrafterConfig, DSparkHeads
from blockspec.kernels.markov import MAX_ROWS as MARKOV_KERNEL_ROWS, markov_greedy
from blockspec.kernels.ops import use_kernels
from blockspec.sample import RowParams, sample_draft


class MarkovHead(nn.Module):
    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, head_type: str) -> None:
        super().__init__()
        self.head_type = head_type
        self.rank = rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def latent(self, h_k: Tensor, prev_ids: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """The rank-r vector W2 is applied to, and the new recurrent state (rnn only)."""
        e = self.markov_w1(prev_ids.long())
        if self.head_type == "vanilla":
            return e, None
        h_k = h_k.to(e.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h_k, e], dim=-1)))
            return gate.to(e.dtype) * e, None
        if state is None:
            state = torch.zeros_like(e)
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, e, h_k], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), new_state


BIAS_ROWS_BYTES = 64 << 20  # the memory a vanilla Markov head's remembered bias rows may take (CPU)


class BiasRows:
    """A vanilla Markov head's bias rows B(t) = W2 W1[t] for the previous tokens t seen last (CPU
    inference). The bias depends on the previous token alone, and computing one reads all of W2 (rank
    x draft vocabulary): on the CPU a step's eight of them are the largest part of its draft heads.
    Drafts repeat tokens (a code model's indentation, brackets, names), so most rows are found here.
    Each row is computed on its own, exactly as a one-row step computes it, so a row is the same
    whichever batch first asked for it; the rows are dropped when W1 or W2 change (their version
    counters)."""

    def __init__(self) -> None:
        self.rows: OrderedDict[int, Tensor] = OrderedDict()  # least recently used first
        self.key: tuple[int, ...] | None = None

    def take(self, head: MarkovHead, prev_ids: list[int], scale: float) -> Tensor:
        """[R, V_draft] fp32 bias rows for the previous tokens `prev_ids` (R target ids)."""
        out = self.rows_for(head, prev_ids, scale)
        return out[0][None] if len(out) == 1 else torch.stack(out)

    def rows_for(self, head: MarkovHead, prev_ids: list[int], scale: float) -> list[Tensor]:
        """The [V_draft] fp32 bias row of each previous token in `prev_ids`, remembered or computed."""
        w1, w2 = head.markov_w1.weight, head.markov_w2.weight
        key = (w1.data_ptr(), w1._version, w2.data_ptr(), w2._version)
        if key != self.key:
            self.rows.clear()
            self.key = key
        capacity = max(1, BIAS_ROWS_BYTES // (4 * w2.shape[0]))
        out = []
        for t in prev_ids:
            row = self.rows.get(t)
            if row is None:
                row = head.markov_w2(head.markov_w1(torch.tensor([t], device=w1.device))).float()[0]
                row = row * scale if scale != 1.0 else row
                self.rows[t] = row
                if len(self.rows) > capacity:
                    self.rows.popitem(last=False)
            else:
                self.rows.move_to_end(t)
            out.append(row)
        return out


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)


class DSparkDraft(DraftModel):
    """DSpark drafter (DeepSpec ``Qwen3DSparkModel`` or speculators ``dspark``)."""

    source_format = "deepspec"

    def __init__(self, cfg: DrafterConfig, heads: DSparkHeads, embed_rows: int | None = None,
                 head_rows: int | None = None, has_d2t: bool = False) -> None:
        super().__init__(cfg, embed_rows=embed_rows, head_rows=head_rows, has_d2t=has_d2t)
        self.heads = heads
        draft_vocab = head_rows or cfg.vocab_size
        self.markov_head = (MarkovHead(cfg.vocab_size, draft_vocab, heads.markov_rank, cfg.hidden_size,
                                       heads.markov_head_type) if heads.markov_rank > 0 else None)
        self.bias_rows = BiasRows()
        self.confidence_head = None
        if heads.enable_confidence_head:
            dim = cfg.hidden_size + (heads.markov_rank if heads.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim)

    # ------------------------------------------------------------------ checks
    def check_target(self, target_cfg: ModelConfig) -> None:
        super().check_target(target_cfg)
        last = target_cfg.num_hidden_layers - 1
        if last in self.target_layer_ids:
            raise ConfigError(
                f"DSparkDraft: target_layer_ids {list(self.target_layer_ids)} include the target's last layer {last}; "
                "DSpark is trained on raw decoder-layer outputs and HF's last hidden state is post-norm "
                "(DeepSpec assert_no_final_target_layer)")
        if self.markov_head is not None and self.markov_head.markov_w1.num_embeddings != target_cfg.vocab_size:
            raise ConfigError(f"DSparkDraft: markov_w1 has {self.markov_head.markov_w1.num_embeddings} rows but the "
                              f"target vocab_size is {target_cfg.vocab_size} (W1 is indexed by target token ids)")

    def _check_vocab(self, target_cfg: ModelConfig) -> None:
        if self.use_own_head:
            super()._check_vocab(target_cfg)
            return
        # shared target head: the Markov bias must cover the target vocabulary
        if self.markov_head is not None and self.markov_head.markov_w2.out_features != target_cfg.vocab_size:
            raise ConfigError(f"DSparkDraft: markov_w2 has {self.markov_head.markov_w2.out_features} rows but the "
                              f"shared target LM head has vocab_size {target_cfg.vocab_size}")
        super()._check_vocab(target_cfg)

    # ------------------------------------------------------------------ heads
    @property
    def markov_head_type(self) -> str | None:
        return self.markov_head.head_type if self.markov_head is not None else None

    def markov_step(self, k: int, h_k: Tensor, prev_ids: Tensor, state: Tensor | None) -> tuple[Tensor | None,
                                                                                                  Tensor | None]:
        """Markov bias for draft position k (0-based): ([R, V_draft] fp32 or None without a head, new state)."""
        del k  # every DeepSpec head is position-agnostic; kept in the signature for future heads
        if self.markov_head is None:
            return None, None
        if (self.markov_head.head_type == "vanilla" and prev_ids.device.type == "cpu"
                and not torch.is_grad_enabled()):
            return self.bias_rows.take(self.markov_head, prev_ids.tolist(), self.config.logit_scale), None
        latent, state = self.markov_head.latent(h_k, prev_ids, state)
        bias = self.markov_head.markov_w2(latent).float()
        if self.config.logit_scale != 1.0:
            bias = bias * self.config.logit_scale
        return bias, state

    def markov_bias_at(self, latent: Tensor, columns: Tensor) -> Tensor:
        """W2 rows `columns` [R, k] applied to `latent` [R, r]: the bias restricted to those draft columns."""
        w = self.markov_head.markov_w2.weight[columns]  # [R, k, r]
        bias = torch.bmm(w, latent.to(w.dtype).unsqueeze(-1)).squeeze(-1).float()
        return bias * self.config.logit_scale if self.config.logit_scale != 1.0 else bias

    def confidence(self, h_k: Tensor, prev_ids: Tensor | None = None, logits: bool = False) -> Tensor:
        """c_k = sigmoid(w^T [h_k ; W1[prev]] + b), [R] fp32 (the pre-sigmoid logit with logits=True)."""
        if self.confidence_head is None:
            raise ValueError("DSparkDraft.confidence: this checkpoint has no confidence head")
        if self.heads.confidence_head_with_markov:
            if prev_ids is None:
                raise ValueError("DSparkDraft.confidence: prev_ids needed (confidence_head_with_markov)")
            e = self.markov_head.markov_w1(prev_ids.long())
            features = torch.cat([h_k, e.to(h_k.dtype)], dim=-1)
        else:
            features = h_k
        proj = self.confidence_head.proj
        out = F.linear(features.float(), proj.weight.float(), proj.bias.float()).squeeze(-1)
        return out if logits else torch.sigmoid(out)

    @property
    def has_confidence(self) -> bool:
        return self.confidence_head is not None

    def block_confidence(self, h: Tensor, anchors: Tensor, tokens: Tensor) -> Tensor | None:
        """c_k of every drafted position at once, [R, K] (None without a confidence head): position k's
        previous token is the anchor for k = 0, else draft k - 1. One product after the left-to-right
        loop, since no confidence feeds back into the drafts."""
        if self.confidence_head is None:
            return None
        if tokens.shape[1] == 0:
            return h.new_zeros(tokens.shape, dtype=torch.float32)
        prev = torch.cat([anchors.long()[:, None], tokens[:, :-1].clamp(min=0)], dim=1)
        return self.confidence(h[:, : tokens.shape[1]], prev)

    def greedy_drafts(self, slot_hidden: Tensor, anchors: Tensor, top_k: int = 0,
                      head_argmax: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
        return self.draft_greedy(self.logits(slot_hidden), slot_hidden, anchors, top_k)

    def sample_drafts(self, slot_hidden: Tensor, anchors: Tensor, params: RowParams, round_: Tensor, vocab: int,
                      top_k: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
        """Left to right: position k's distribution depends, through the Markov head, on the token drawn
        at k - 1 (without a Markov head every position is drawn at once)."""
        if self.markov_head is None:
            return self._sample_independent(slot_hidden, params, round_, vocab)
        r, k = slot_hidden.shape[:2]
        base = self.logits(slot_hidden)
        prev, state = anchors, None
        tokens, qs = [], []
        for i in range(k):
            rows = torch.arange(r, device=slot_hidden.device) * k + i
            logits_i, state = self._markov_logits(i, base[:, i], slot_hidden[:, i], prev, state, top_k)
            logits_i = self.scatter_to_target(logits_i, vocab, float("-inf"))
            tok, q = sample_draft(logits_i[:, None], params.take(rows), round_)
            prev = tok[:, 0].clamp(min=0)
            tokens.append(tok[:, 0])
            qs.append(q[:, 0])
        drafts = torch.stack(tokens, 1)
        return drafts, torch.stack(qs, 1), self.block_confidence(slot_hidden, anchors, drafts)

    def _markov_logits(self, i: int, base: Tensor, h: Tensor, prev: Tensor, state: Tensor | None,
                       top_k: int) -> tuple[Tensor, Tensor | None]:
        """U_k + B_k(prev) over the draft vocabulary, and the Markov state; with top_k only the top-k
        columns of U_k stay candidates (others -inf), so the truncated distribution is the q verified."""
        if 0 < top_k < base.shape[-1]:
            values, columns = base.float().topk(top_k, dim=-1)
            latent, state = self.markov_head.latent(h, prev, state)
            out = torch.full_like(base, float("-inf"), dtype=torch.float32)
            return out.scatter_(-1, columns, values + self.markov_bias_at(latent, columns)), state
        bias, state = self.markov_step(i, h, prev, state)
        return base + bias, state

    def _draft_greedy_remembered(self, base_logits: Tensor, anchor_ids: Tensor) -> Tensor:
        """`draft_greedy`'s loop for a vanilla head on the CPU: each bias row remembered by its previous token
        (`BiasRows`, the row `markov_step` gives), the previous tokens kept as host ints, and a position's add
        and argmax over the vocabulary in NumPy over the same float32 values (the same sums, the first of
        ties), a few microseconds where a torch op's dispatch alone costs about as much."""
        base = base_logits.float().numpy()
        r, k_total, v = base.shape
        d2t = self.d2t.numpy() if self.d2t is not None and self.use_own_head else None  # a view, not a copy
        prev = anchor_ids.tolist()
        tokens = np.empty((r, k_total), dtype=np.int64)
        scratch = np.empty(v, dtype=np.float32)
        for k in range(k_total):
            for i, bias in enumerate(self.bias_rows.rows_for(self.markov_head, prev, self.config.logit_scale)):
                np.add(base[i, k], bias.numpy(), out=scratch)
                column = int(scratch.argmax())
                tokens[i, k] = column if d2t is None else column + int(d2t[column])
            prev = tokens[:, k].tolist()
        return torch.from_numpy(tokens)

    def draft_greedy(self, base_logits: Tensor, h: Tensor, anchor_ids: Tensor,
                     top_k: int = 0) -> tuple[Tensor, Tensor | None]:
        """Sequential argmax drafting: logits_k = U_k + B_k(prev), token = argmax, prev = token.

        base_logits [R, K, V_draft] (``logits``), h [R, K, H] (``slot_hidden``), anchor_ids [R] target ids.
        Returns (tokens [R, K] target ids, confidences [R, K] or None). With top_k > 0 only the top_k
        columns of U_k are candidates and the bias is computed for those only.
        """
        r, k_total, v = base_logits.shape
        prev = anchor_ids.long()
        state = None
        tokens = []
        use_topk = self.markov_head is not None and 0 < top_k < v
        head = self.markov_head
        vanilla = head is not None and head.head_type == "vanilla" and not use_topk
        if vanilla and r <= MARKOV_KERNEL_ROWS and use_kernels(base_logits, head.markov_w1.weight,
                                                                head.markov_w2.weight):  # a launch a position
            d2t = self.d2t if self.use_own_head else None
            toks = markov_greedy(base_logits.float(), head.markov_w1.weight, head.markov_w2.weight, prev, d2t,
                                 self.config.logit_scale)
            return toks, self.block_confidence(h, anchor_ids, toks)
        if vanilla and base_logits.device.type == "cpu" and not torch.is_grad_enabled():
            toks = self._draft_greedy_remembered(base_logits, anchor_ids)
            return toks, self.block_confidence(h, anchor_ids, toks)
        for k in range(k_total):
            h_k = h[:, k]
            base_k = base_logits[:, k].float()
            # max's indices: argmax's ids (the first of ties), in a third of its CPU time over a vocabulary
            if self.markov_head is None:
                draft = base_k.max(dim=-1).indices
            elif use_topk:
                values, columns = base_k.topk(top_k, dim=-1)
                latent, state = self.markov_head.latent(h_k, prev, state)
                scores = values + self.markov_bias_at(latent, columns)
                draft = columns.gather(-1, scores.argmax(dim=-1, keepdim=True)).squeeze(-1)
            else:
                bias, state = self.markov_step(k, h_k, prev, state)
                draft = (base_k + bias).max(dim=-1).indices
            prev = self.draft_to_target(draft)
            tokens.append(prev)
        toks = torch.stack(tokens, dim=1) if tokens else base_logits.new_zeros((r, 0), dtype=torch.int64)
        return toks, self.block_confidence(h, anchor_ids, toks)
