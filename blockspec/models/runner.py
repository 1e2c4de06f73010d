"""Target forwards for the engine: packs requests' token runs into one padded batch on the device.

On CUDA, forwards replay captured CUDA graphs, bucketed by batch size, query width and (SDPA only)
key length, so Python and kernel launch overhead bound neither batch-1 decoding nor a busy server:
decode and verify (every request feeds at most one verify width of tokens), and with the Triton
attention kernel prefill batches of up to `graph_prefill_tokens` padded tokens (widths in powers of
two from 16). An eager forward costs about ten launches a layer from Python whatever its size, many
times a graph replay, and at a busy server nearly every step holds a prefill. Longer prefill chunks and CPU runs take the eager path, which is the
reference the graph path is tested against.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from blockspec.models.kv_cache import KVCache, PageTable, causal_meta, meta_from_tensors
from blockspec.models.llama import CausalLM
from blockspec.sample.processors import Columns, Features, RowParams
from blockspec.sample.sampler import greedy_ids, sample
from blockspec.transfer import copy_from_host, to_device

T = TypeVar("T")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KV_BUCKET = 256
MIN_PREFILL_WIDTH = 16


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


def prefill_graph_widths(tokens: int) -> list[int]:
    """Query widths prefill graphs are captured for: powers of two from 16 up to `tokens` (a run
    pads to at most twice its length, and a batch of b runs of width w is graphed if b x w <= tokens)."""
    return [MIN_PREFILL_WIDTH << i for i in range(32) if MIN_PREFILL_WIDTH << i <= tokens]


HEAD_GRAPH_ELEMS = 1 << 21
"""Rows x vocab a graph of the plain step's head and sampler serves at most: its logits and the sampler's
temporaries (a top-k / top-p sort's values and indices, about 50 bytes an element) stay in the graphs' pool
for the engine's life. Larger batches of a large vocabulary run eagerly, where the launches cost relatively
little."""

SAMPLED_HEAD = Features(sampled=True, top_k=False, top_p=False, min_p=True, greedy=True)
FILTERED_HEAD = Features(sampled=True, top_k=True, top_p=True, min_p=True, greedy=True)

CAPTURES = [0]  # graphs captured so far in this process (a step that captured is not a timing sample)


def capture(fn: Callable[[], T], pool: object, outputs_outside: bool = False) -> tuple["torch.cuda.CUDAGraph", T]:
    """Warm `fn` up on a side stream (compilation, allocator, cuBLAS workspaces), then capture one call
    into a CUDA graph drawing on the shared memory pool; returns the graph and its static outputs.

    `outputs_outside`: `fn` returns a tuple of tensors (or None), which the graph copies into buffers
    made outside the pool. A pool shared by graphs captured one after another is safe for what it
    holds at each capture's end; memory an earlier graph used as scratch may become a later graph's
    output, which the earlier graph's next replay overwrites. Outputs outside the pool cannot be."""
    CAPTURES[0] += 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        warm = fn()
    torch.cuda.current_stream().wait_stream(side)
    run = _copying_into(fn, tuple(None if t is None else torch.empty_like(t) for t in warm)) if outputs_outside else fn
    del warm
    graph = torch.cuda.CUDAGraph()
    # no cyclic garbage collection while capturing: freeing a dead engine's graphs or memory there (a
    # reference cycle in the caller's objects) would invalidate the capture
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    finally:
        if collecting:
            gc.enable()
    return graph, out


def _copying_into(fn: Callable[[], Any], buffers: tuple[Tensor | None, ...]) -> Callable[[], Any]:
    """`fn`, its outputs copied into `buffers` (a None output stays None)."""
    def run() -> tuple[Tensor | None, ...]:
        for buf, t in zip(buffers, fn()):
            if buf is not None:
                buf.copy_(t)
        return buffers
    return run


def pool_bytes(pool: object | None) -> int:
    """What the caching allocator holds in a graph memory pool (its segments; 0 before a capture).
    Read from the pool itself, not from the reservation's growth, which other engines' frees blur."""
    if pool is None:
        return 0
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool))


@dataclass
class CapturedForward:
    graph: "torch.cuda.CUDAGraph"
    ids: Tensor  # [B, Q] static input
    # [8, B] static input: slots, starts, q_lens, tap sink slot and column, draft context slot, start and
    # rows (see ModelRunner)
    control: Tensor
    hidden: Tensor  # [B, Q, H] static output
    features: Tensor | None  # [B, Q, F] static output


@dataclass
class CapturedHead:
    graph: "torch.cuda.CUDAGraph"
    hidden: Tensor  # [B, H] static input
    floats: Tensor | None  # [6, B] and [4, B] static inputs: the rows' `Columns` (None for the greedy head)
    ints: Tensor | None
    ids: Tensor  # [B] static output, outside the graphs' pool


class ModelRunner:
    """Owns the target model and its KV cache; every forward is `tokens at positions -> hidden (+ taps)`.

    `tap_sink` [slots + 1, C, F] (the proposer's buffer of context not yet drafted from): a forward
    given `hold` writes each request's first-row taps straight into it, inside the captured graph,
    instead of returning them, so a plain step of a speculating request costs no extra host work.

    Prefill graphs (`graph_prefill_tokens` > 0, Triton attention) write their outputs into buffers
    all of them share: each graph keeping its own [b, w, H] hidden and taps would hold gigabytes for
    a large model, and a prefill's outputs are read in the step that made them. With `context_sink`
    (slots, starts, rows, taps: the drafter's context append, device-only) a tapped prefill graph
    hands the chunk's taps to the drafter's cache itself, so the prompt's draft context costs no
    launches from the host (the eager path returns the taps, and the engine appends them)."""

    def __init__(self, model: CausalLM, pages: PageTable | int, max_len: int, taps: Sequence[int] = (),
                 use_cuda_graphs: bool | None = None, query_buckets: Sequence[int] = (),
                 tap_sink: Tensor | None = None, graph_prefill_tokens: int = 0,
                 context_sink: Callable[[Tensor, Tensor, Tensor, Tensor], None] | None = None) -> None:
        self.model = model
        self.tap_sink = tap_sink
        # graphed forwards pad their query rows up to one of these lengths (the verify widths the
        # draft policy can choose), so drafts cut short by a budget or by confidence reuse a graph
        # instead of capturing one per width
        self.query_buckets = tuple(sorted(set(query_buckets) | {1}))
        self.device = model.embed_tokens.weight.device
        self.cache: KVCache = model.new_cache(pages, max_len, self.device)
        self.taps = tuple(taps)
        self.use_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.graphs: dict[tuple[int, int, int, bool], CapturedForward] = {}
        self.head_graphs: dict[tuple[int, Features | None], CapturedHead] = {}  # (batch bucket, sampled rows' features)
        self.graph_prefill_tokens = graph_prefill_tokens
        self.context_sink = context_sink
        # greedy ids of several rows where not the argmax of the head's logits (a speculative engine on the CPU
        # sets one that screens its drafter's bfloat16 copy of the head: `models.cpu_linear.ScreenedGreedy`);
        # None where a row is bad. The runner's, not the model's: engines that share a model (a benchmark's) each
        # decode as they would alone
        self.head_screen: Callable[[Tensor], Tensor | None] | None = None
        # (hidden [N, H], taps [N, F]) that every prefill graph writes
        self._prefill_out: tuple[Tensor, Tensor] | None = None
        self.pool = None  # the memory pool every graph of this model shares (made at its first capture)

    def forward(
        self, runs: Sequence[Sequence[int]], starts: Sequence[int], slots: Sequence[int], with_taps: bool = False,
        hold: tuple[list[int], list[int]] | None = None, context: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """runs[r] are token ids fed at positions starts[r], ...; returns hidden [R, Q, H], taps [R, Q, F].

        `context` = (draft cache slots, starts, rows) per request: where a prefill graph that serves
        this forward appends the taps to the drafter's cache (`context_sink`); it then returns no taps.
        A forward no such graph serves returns them."""
        q = max(len(r) for r in runs)
        ids = to_device([list(run) + [0] * (q - len(run)) for run in runs], torch.int64, self.device)
        return self.forward_ids(ids, [len(r) for r in runs], starts, slots, with_taps, hold=hold, context=context)

    def forward_ids(
        self, ids: Tensor, q_lens: Sequence[int], starts: Sequence[int], slots: Sequence[int],
        with_taps: bool = False, hold: tuple[list[int], list[int]] | None = None,
        context: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Same as `forward` with the ids already a padded device tensor [R, Q] (e.g. anchors + drafts).

        `hold` = (sink slots, sink columns) per request: first-row taps go to `tap_sink` there (the
        scratch slot for a request that keeps none) and no taps are returned."""
        if hold is not None:
            assert with_taps and self.tap_sink is not None, "hold needs taps and a tap sink"
        r, q = ids.shape
        kv_len = max(s + n for s, n in zip(starts, q_lens))
        key = self.graph_key(r, q, kv_len, with_taps)
        if key is not None and context is None and self.sinks_context(key):
            key = None  # that graph would hand the taps to the drafter, and this caller wants them back
        if key is not None:
            return self._replay(ids, q_lens, starts, slots, with_taps, key, hold, context)
        cfg = self.model.config
        meta = causal_meta(list(slots), list(starts), list(q_lens), q, self.cache.trash, self.device,
                           cfg.sliding_window, cfg.layer_types, kv_len)
        hidden, features = self.model(ids, meta, self.cache, self.taps if with_taps else ())
        if hold is None:
            return hidden, features
        sink = to_device(list(hold), torch.int64, self.device)
        self._sink(features, sink[0], sink[1])
        return hidden, None

    def forward_tensors(self, ids: Tensor, slots: Tensor, starts: Tensor, q_lens: Tensor, kv_len: int,
                        with_taps: bool = True) -> tuple[Tensor, Tensor | None]:
        """The eager forward with every argument on the device (capturable: the chained step's verify):
        rows ids[r, :q_lens[r]] at positions starts[r]..., keys up to `kv_len`."""
        cfg = self.model.config
        meta = meta_from_tensors(slots, starts, q_lens, ids.shape[1], kv_len, self.cache.trash, cfg.sliding_window,
                                 cfg.layer_types)
        return self.model(ids, meta, self.cache, self.taps if with_taps else ())

    def _sink(self, features: Tensor, slots: Tensor, columns: Tensor) -> None:
        """Each request's first-row taps into tap_sink[slots[r], columns[r]] (one scatter)."""
        self.tap_sink[slots, columns] = features[:, 0]

    # ---------------------------------------------------------------- CUDA graphs
    @property
    def whole_cache_graphs(self) -> bool:
        return self.model.attention_backend == "triton"

    def kv_extent(self, kv_len: int) -> int:
        return kv_extent(kv_len, self.cache.max_len + 1, self.whole_cache_graphs)

    @property
    def prefill_widths(self) -> list[int]:
        """Prefill graph widths: with the Triton kernel only (SDPA graphs are also bucketed by key
        length, which would multiply them), and only where the cache allows such a width."""
        if not (self.use_graphs and self.whole_cache_graphs):
            return []
        return [w for w in prefill_graph_widths(self.graph_prefill_tokens) if w <= self.cache.max_len]

    def sinks_context(self, key: tuple[int, int, int, bool]) -> bool:
        """Whether the graph of `key` appends its taps to the drafter's cache: a tapped prefill graph."""
        return key[3] and key[1] not in self.query_buckets and self.context_sink is not None

    def graph_key(self, rows: int, width: int, kv_len: int, with_taps: bool) -> tuple[int, int, int, bool] | None:
        """The captured graph that serves `rows` requests of up to `width` tokens, or None (eager)."""
        b = bucket(rows, BATCH_BUCKETS)
        if not self.use_graphs or b is None:
            return None
        w = bucket(width, self.query_buckets)
        if w is None:
            w = bucket(width, self.prefill_widths)
            if w is not None and b * w > self.graph_prefill_tokens:
                return None
        return None if w is None else (b, w, self.kv_extent(kv_len), with_taps)

    def capture_all(self, batch_sizes: Sequence[int], tapped: bool, untapped: bool) -> None:
        """Capture every graph a step of these batch buckets can replay: each query width, each key
        extent, with taps (steps where requests may draft) and / or without, the prefill graphs
        of each width that holds the batch within `graph_prefill_tokens`, and the plain step's heads."""
        kinds = [t for t, wanted in ((True, tapped), (False, untapped)) if wanted]
        extents = kv_extents(self.cache.max_len + 1, self.whole_cache_graphs)
        keys = [(b, width, kv, taps) for b in batch_sizes for kv in extents for width in self.query_buckets
                for taps in kinds]
        keys += [(b, width, self.kv_extent(0), taps) for width in self.prefill_widths for b in batch_sizes
                 if b * width <= self.graph_prefill_tokens for taps in kinds]
        for key in keys:
            if key not in self.graphs:
                self._capture(key)
        # the plain step's head, greedy and sampled (a batch that filters by top-k / top-p captures its own)
        for head in {self.head_key(b, feats) for b in batch_sizes for feats in (None, SAMPLED_HEAD)} - {None}:
            if head not in self.head_graphs:
                self._capture_head(*head)

    def _replay(self, ids: Tensor, q_lens: Sequence[int], starts: Sequence[int], slots: Sequence[int],
                with_taps: bool, key: tuple[int, int, int, bool], hold: tuple[list[int], list[int]] | None = None,
                context: tuple[list[int], list[int], list[int]] | None = None) -> tuple[Tensor, Tensor | None]:
        r, q = ids.shape
        b = key[0]
        cap = self.graphs.get(key) or self._capture(key)
        pad, scratch = b - r, self.cache.scratch_slot
        sink_slots, sink_cols = hold if hold is not None else ([scratch] * r, [0] * r)
        sunk = self.sinks_context(key)
        ctx_slots, ctx_starts, ctx_rows = context if sunk else ([scratch] * r, [0] * r, [0] * r)
        cap.control.copy_(to_device([list(slots) + [scratch] * pad, list(starts) + [0] * pad, list(q_lens) + [0] * pad,
                                     list(sink_slots) + [scratch] * pad, list(sink_cols) + [0] * pad,
                                     list(ctx_slots) + [scratch] * pad, list(ctx_starts) + [0] * pad,
                                     list(ctx_rows) + [0] * pad], torch.int64, self.device))
        cap.ids[:r, :q].copy_(ids)
        cap.graph.replay()
        if hold is not None or sunk:
            return cap.hidden[:r, :q], None
        # Features outlive this replay (they become draft context later): copy them out.
        feats = cap.features[:r, :q].clone() if cap.features is not None else None
        return cap.hidden[:r, :q], feats

    def _capture(self, key: tuple[int, int, int, bool]) -> CapturedForward:
        b, q, kv_len, with_taps = key
        cfg = self.model.config
        ids = torch.zeros(b, q, dtype=torch.int64, device=self.device)
        control = torch.zeros(8, b, dtype=torch.int64, device=self.device)
        control[0] = control[3] = control[5] = self.cache.scratch_slot  # warm-up and capture write the scratch slot
        shared = self._shared_prefill_out() if q not in self.query_buckets else None
        sunk = self.sinks_context(key)

        def run() -> tuple[Tensor, Tensor | None]:
            meta = meta_from_tensors(control[0], control[1], control[2], q, kv_len, self.cache.trash,
                                     cfg.sliding_window, cfg.layer_types)
            hidden, features = self.model(ids, meta, self.cache, self.taps if with_taps else ())
            if sunk:
                self.context_sink(control[5], control[6], control[7], features)
                features = None
            elif features is not None and self.tap_sink is not None and shared is None:
                self._sink(features, control[3], control[4])
            if shared is not None:  # a prefill graph: its outputs go where every prefill graph's go
                hidden = shared[0][: b * q].view(b, q, -1).copy_(hidden)
                if features is not None:
                    features = shared[1][: b * q].view(b, q, -1).copy_(features)
            return hidden, features

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, (hidden, features) = capture(run, self.pool)
        cap = CapturedForward(graph, ids, control, hidden, features)
        self.graphs[key] = cap
        return cap

    def _shared_prefill_out(self) -> tuple[Tensor, Tensor]:
        """The buffers every prefill graph writes its hidden rows and taps into (made once, outside any
        capture, so no graph's pool holds them)."""
        if self._prefill_out is None:
            n, h = self.graph_prefill_tokens, self.model.config.hidden_size
            dtype = self.model.embed_tokens.weight.dtype
            self._prefill_out = (torch.empty(n, h, dtype=dtype, device=self.device),
                                 torch.empty(n, len(self.taps) * h, dtype=dtype, device=self.device))
        return self._prefill_out

    # ---------------------------------------------------------------- heads
    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.compute_logits(hidden)

    def greedy_ids(self, hidden: Tensor, max_bytes: int = 1 << 28) -> Tensor:
        """Argmax token per row (-1 for a non-finite row) of the head's own-dtype logits, holding at most
        `max_bytes` of them at once. Chunks stay large: each one reads the whole LM head. Several rows take the
        runner's `head_screen` where it has one (the same ids)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        screen = self.head_screen
        if screen is not None and flat.shape[0] > 1 and (ids := screen(flat)) is not None:
            return ids.view(hidden.shape[:-1])
        out = torch.empty(flat.shape[0], dtype=torch.int64, device=flat.device)
        row_bytes = self.model.config.vocab_size * flat.element_size()
        chunk_rows = max(1, max_bytes // row_bytes)
        for i in range(0, flat.shape[0], chunk_rows):
            out[i : i + chunk_rows] = greedy_ids(self.model.head_logits(flat[i : i + chunk_rows]))
        return out.view(hidden.shape[:-1])

    def next_ids(self, hidden: Tensor, columns: Columns | None = None) -> Tensor:
        """The plain step's token for each row of `hidden` [R, H]: greedy (`columns` None), or drawn by
        `sample` with the rows' values as host `Columns` (sampling that needs nothing else: no history, bias
        or masks). On a GPU one replay of a graph of the head and the sampler (`head_key`): the tokens of the
        eager path, without a launch from the host for each of its kernels, which is most of a small model's
        plain step."""
        if columns is not None and not columns.features.sampled:
            columns = None  # greedy rows with nothing to apply: `sample` takes the raw argmax too
        key = self.head_key(hidden.shape[0], None if columns is None else columns.features)
        if key is None or torch.cuda.is_current_stream_capturing():
            if columns is None:
                return self.greedy_ids(hidden)
            return sample(self.logits(hidden), columns.params(self.device))
        cap = self.head_graphs.get(key) or self._capture_head(*key)
        r = hidden.shape[0]
        cap.hidden[:r].copy_(hidden)
        if columns is not None:
            padded = columns.padded(key[0])
            copy_from_host(cap.floats, padded.floats)
            copy_from_host(cap.ints, padded.ints)
        cap.graph.replay()
        return cap.ids[:r]

    def head_key(self, rows: int, feats: Features | None) -> tuple[int, Features | None] | None:
        """The head graph that serves `rows` rows sampled with `feats` (None: greedy ids): (batch bucket, the
        features it is captured for), or None (eager: no graphs, or more rows x vocab than HEAD_GRAPH_ELEMS).
        A processor a row leaves off is an exact identity on it (processors.py), so two sampled graphs a
        bucket serve every batch: one without top-k and top-p, one with both (a sort of every row)."""
        b = bucket(rows, BATCH_BUCKETS)
        if not self.use_graphs or b is None or b * self.model.config.vocab_size > HEAD_GRAPH_ELEMS:
            return None
        if feats is None:
            return b, None
        return b, FILTERED_HEAD if feats.top_k or feats.top_p else SAMPLED_HEAD

    def _capture_head(self, b: int, feats: Features | None) -> CapturedHead:
        """The graph of the head and sampler for `b` rows: greedy ids, or `sample` for rows of these features
        (inputs written before each replay)."""
        h = self.model.config.hidden_size
        hidden = torch.zeros(b, h, dtype=self.model.embed_tokens.weight.dtype, device=self.device)
        floats = ints = None
        if feats is not None:  # every row greedy-free and neutral until the first replay writes them
            floats = torch.tensor([[1.0] * b, [1.0] * b, [0.0] * b, [0.0] * b, [0.0] * b, [1.0] * b],
                                  device=self.device)
            ints = torch.zeros(4, b, dtype=torch.int64, device=self.device)

        def run() -> tuple[Tensor]:
            if feats is None:
                return (greedy_ids(self.model.head_logits(hidden)),)
            return (sample(self.logits(hidden), RowParams.from_columns(floats, ints, feats)),)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, (ids,) = capture(run, self.pool, outputs_outside=True)
        cap = self.head_graphs[(b, feats)] = CapturedHead(graph, hidden, floats, ints, ids)
        return cap
