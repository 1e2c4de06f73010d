"""Target forwards for the engine: packs requests' token runs into one padded batch on the device.

On CUDA, fixed-shape forwards (decode and verify: every request feeds at most one verify width of
tokens) replay captured CUDA graphs, bucketed by batch size, query width and (SDPA only) key
length, so Python and kernel launch overhead do not bound batch-1 speed. Longer prefill chunks and
CPU runs take the eager path, which is the reference the graph path is tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from blockspec.engine.kv_cache import KVCache, causal_meta, meta_from_tensors
from blockspec.models.llama import CausalLM
from blockspec.sample.sampler import greedy_ids
from blockspec.transfer import to_device

T = TypeVar("T")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KV_BUCKET = 256


def bucket(value: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= value), None)


def kv_extents(cap: int, whole: bool) -> list[int]:
    """Key lengths graphs are captured for, up to `cap`. The Triton kernel stops at each row's last
    key whatever the extent, so one extent (the whole cache) serves every context; SDPA's mask is
    as wide as the extent, so its graphs are bucketed by length (256, 512, 1024, ...)."""
    if whole:
        return [cap]
    return sorted({min(MIN_KV_BUCKET << i, cap) for i in range(24) if (MIN_KV_BUCKET << i) // 2 < cap})


def kv_extent(length: int, cap: int, whole: bool) -> int:
    """The captured extent that serves `length` keys."""
    return bucket(length, kv_extents(cap, whole))


CAPTURES = [0]  # graphs captured so far in this process (a step that captured is not a timing sample)


def capture(fn: Callable[[], T], pool: object) -> tuple["torch.cuda.CUDAGraph", T]:
    """Warm `fn` up on a side stream (compilation, allocator, cuBLAS workspaces), then capture one call
    into a CUDA graph drawing on the shared memory pool; returns the graph and its static outputs."""
    CAPTURES[0] += 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


@dataclass
class CapturedForward:
    graph: "torch.cuda.CUDAGraph"
    ids: Tensor  # [B, Q] static input
    control: Tensor  # [5, B] static input: slots, starts, q_lens, tap sink slot and column (see ModelRunner)
    hidden: Tensor  # [B, Q, H] static output
    features: Tensor | None  # [B, Q, F] static output


class ModelRunner:
    """Owns the target model and its KV cache; every forward is `tokens at positions -> hidden (+ taps)`.

    `tap_sink` [slots + 1, C, F] (the proposer's buffer of context not yet drafted from): a forward
    given `hold` writes each request's first-row taps straight into it, inside the captured graph,
    instead of returning them, so a plain step of a speculating request costs no extra host work."""

    def __init__(self, model: CausalLM, max_slots: int, max_len: int, taps: Sequence[int] = (),
                 use_cuda_graphs: bool | None = None, query_buckets: Sequence[int] = (),
                 tap_sink: Tensor | None = None) -> None:
        self.model = model
        self.tap_sink = tap_sink
        # graphed forwards pad their query rows up to one of these lengths (the verify widths the
        # draft policy can choose), so drafts cut short by a budget or by confidence reuse a graph
        # instead of capturing one per width
        self.query_buckets = tuple(sorted(set(query_buckets) | {1}))
        self.device = model.embed_tokens.weight.device
        self.cache: KVCache = model.new_cache(max_slots, max_len, self.device)
        self.taps = tuple(taps)
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.graphs: dict[tuple[int, int, int, bool], CapturedForward] = {}
        self._pool = None

    def forward(
        self, runs: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int], with_taps: bool = False,
        hold: tuple[list[int], list[int]] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """runs[r] are token ids fed at positions starts[r], ...; returns hidden [R, Q, H], taps [R, Q, F]."""
        q = max(len(r) for r in runs)
        ids = to_device([list(run) + [0] * (q - len(run)) for run in runs], torch.int64, self.device)
        return self.forward_ids(ids, [len(r) for r in runs], starts, slots, with_taps, hold=hold)

    def forward_ids(
        self, ids: Tensor, q_lens: Sequence[int] | Tensor, starts: Sequence[int] | Tensor, slots: Sequence[int],
        with_taps: bool = False, kv_len: int | None = None, hold: tuple[list[int], list[int]] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Same as `forward` with the ids already a padded device tensor [R, Q] (e.g. anchors + drafts).

        `starts` and `q_lens` may be device tensors, computed by the GPU from a step the host has not
        read yet; `kv_len` then bounds every request's last key (the host's worst case).
        `hold` = (sink slots, sink columns) per request: first-row taps go to `tap_sink` there (the
        scratch slot for a request that keeps none) and no taps are returned."""
        if hold is not None:
            assert with_taps and self.tap_sink is not None, "hold needs taps and a tap sink"
        r, q = ids.shape
        on_device = isinstance(starts, Tensor) or isinstance(q_lens, Tensor)
        if kv_len is None:
            assert not on_device, "starts / q_lens on the device need a host bound kv_len"
            kv_len = max(s + n for s, n in zip(starts, q_lens))
        b = bucket(r, BATCH_BUCKETS)
        width = bucket(q, self.query_buckets)
        if self.use_graphs and b is not None and width is not None:
            return self._replay(ids, q_lens, starts, slots, with_taps, (b, width, self.kv_extent(kv_len), with_taps),
                                hold)
        cfg = self.model.config
        if on_device:
            as_t = lambda v: v if isinstance(v, Tensor) else to_device(v, torch.int64, self.device)  # noqa: E731
            meta = meta_from_tensors(as_t(list(slots)), as_t(starts), as_t(q_lens), q, kv_len, self.cache.trash,
                                     cfg.sliding_window, cfg.layer_types)
        else:
            meta = causal_meta(list(slots), list(starts), list(q_lens), q, self.cache.trash, self.device,
                               cfg.sliding_window, cfg.layer_types, kv_len)
        hidden, features = self.model(ids, meta, self.cache, self.taps if with_taps else ())
        if hold is None:
            return hidden, features
        sink = to_device(list(hold), torch.int64, self.device)
        self._sink(features, sink[0], sink[1])
        return hidden, None

    def _sink(self, features: Tensor, slots: Tensor, columns: Tensor) -> None:
        """Each request's first-row taps into tap_sink[slots[r], columns[r]] (one scatter)."""
        self.tap_sink[slots, columns] = features[:, 0]

    # ---------------------------------------------------------------- CUDA graphs
    @property
    def whole_cache_graphs(self) -> bool:
        return self.model.attention_backend == "triton"

    def kv_extent(self, kv_len: int) -> int:
        return kv_extent(kv_len, self.cache.max_len + 1, self.whole_cache_graphs)

    def capture_all(self, batch_sizes: Sequence[int], tapped: bool, untapped: bool) -> None:
        """Capture every graph a step of these batch buckets can replay: each query width, each key
        extent, with taps (steps where requests may draft) and / or without."""
        for b in batch_sizes:
            for kv in kv_extents(self.cache.max_len + 1, self.whole_cache_graphs):
                for width in self.query_buckets:
                    for taps in [t for t, wanted in ((True, tapped), (False, untapped)) if wanted]:
                        if (b, width, kv, taps) not in self.graphs:
                            self._capture((b, width, kv, taps))

    def _replay(self, ids: Tensor, q_lens: Sequence[int] | Tensor, starts: Sequence[int] | Tensor, slots: Sequence[int],
                with_taps: bool, key: tuple[int, int, int, bool],
                hold: tuple[list[int], list[int]] | None = None) -> tuple[Tensor, Tensor | None]:
        r, q = ids.shape
        b = key[0]
        cap = self.graphs.get(key) or self._capture(key)
        host = lambda v: [0] * r if isinstance(v, Tensor) else list(v)  # noqa: E731
        pad, scratch = b - r, self.cache.scratch_slot
        sink_slots, sink_cols = hold if hold is not None else ([scratch] * r, [0] * r)
        cap.control.copy_(to_device([list(slots) + [scratch] * pad, host(starts) + [0] * pad, host(q_lens) + [0] * pad,
                                     list(sink_slots) + [scratch] * pad, list(sink_cols) + [0] * pad],
                                    torch.int64, self.device))
        for row, values in ((1, starts), (2, q_lens)):
            if isinstance(values, Tensor):
                cap.control[row, :r].copy_(values)
        cap.ids[:r, :q].copy_(ids)
        cap.graph.replay()
        if hold is not None:
            return cap.hidden[:r, :q], None
        # Features outlive this replay (they become draft context later): copy them out.
        feats = cap.features[:r, :q].clone() if cap.features is not None else None
        return cap.hidden[:r, :q], feats

    def _capture(self, key: tuple[int, int, int, bool]) -> CapturedForward:
        b, q, kv_len, with_taps = key
        cfg = self.model.config
        ids = torch.zeros(b, q, dtype=torch.int64, device=self.device)
        control = torch.zeros(5, b, dtype=torch.int64, device=self.device)
        control[0] = control[3] = self.cache.scratch_slot  # warm-up and capture write only the scratch slot

        def run() -> tuple[Tensor, Tensor | None]:
            meta = meta_from_tensors(control[0], control[1], control[2], q, kv_len, self.cache.trash,
                                     cfg.sliding_window, cfg.layer_types)
            hidden, features = self.model(ids, meta, self.cache, self.taps if with_taps else ())
            if features is not None and self.tap_sink is not None:
                self._sink(features, control[3], control[4])
            return hidden, features

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, (hidden, features) = capture(run, self._pool)
        cap = CapturedForward(graph, ids, control, hidden, features)
        self.graphs[key] = cap
        return cap

    # ---------------------------------------------------------------- heads
    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)

    def greedy_ids(self, hidden: Tensor, max_logits: int = 1 << 26) -> Tensor:
        """Argmax token per row (-1 for a non-finite row), holding at most `max_logits` fp32 logits at
        once (256 MB). Chunks stay large: each one reads the whole LM head."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
        chunk_rows = max(1, max_logits // self.model.config.vocab_size)
        for i in range(0, flat.shape[0], chunk_rows):
            out[i : i + chunk_rows] = greedy_ids(self.model.compute_logits(flat[i : i + chunk_rows]))
        return out.view(hidden.shape[:-1])
