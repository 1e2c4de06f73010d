"""Paged KV cache: a slot's positions live in fixed-size pages of a shared pool, so memory follows the
tokens requests actually hold, not max_model_len for every slot.

`PageTable` owns the slots and the pages: the device table [slots + 1, columns] maps (slot, position
// page_size) to a page of every pool that shares it (the target's cache and the drafter's, indexed
alike). Each pool per layer is [pages + 1, kv_heads, page_size, head_dim]; the last page is trash:
every table entry no request holds points to it, and padded query rows write there (position
`max_len`, a position no real query reads), so padding never overwrites real keys. A request's
length is still just a number: rollback is free, and rejected rows are overwritten later. Kernels
read the table on the device at run time, so captured CUDA graphs follow pages allocated after
their capture.

With prefix caching on (`enable_prefix_caching`), a full page whose positions hold final K/V (and,
with a drafter, its context) is remembered under its tokens and those of every page before it; a
later request whose prompt starts with the same tokens maps those pages into its slot instead of
prefilling them. A page is freed only when no slot holds it; remembered free pages stay readable
until a reservation needs them, least recently used first.

With `kv_dtype` float8_e4m3fn (`kv_cache_dtype="fp8"`) the pools hold K and V in e4m3, each divided
by its layer's scale (`k_scales`, `v_scales`: a checkpoint's calibrated scales, `KVScales`, one per layer
or one per KV head of each layer, else 1.0, as vLLM takes uncalibrated FP8 caches) and saturated at
+-448: half the bytes a step reads and a page holds. Attention dequantizes as it loads (the kernels) or
after the gather (`gather`, the reference); the model's dtype is unchanged.
"""

from __future__ import annotations

import contextlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from blockspec.config import ConfigError
from blockspec.transfer import to_device


DEFAULT_PAGE_SIZE = 64
FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def kv_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for `EngineConfig.kv_cache_dtype` ("auto": the model's `dtype`)."""
    return dtype if kv_cache_dtype == "auto" else FP8


def per_head(scale: float | Tensor) -> float | Tensor:
    """A cache scale shaped to multiply K or V laid out [..., kv_heads, positions, head_dim]: a per-head
    scale [kv_heads] as [kv_heads, 1, 1]."""
    return scale.view(-1, 1, 1) if isinstance(scale, Tensor) else scale


def quantize_kv(x: Tensor, scale: float | Tensor) -> Tensor:
    """x [..., kv_heads, positions, head_dim] / scale in e4m3, saturated (the store the kernels do: fp32
    times 1 / scale, clamped, rounded); `scale` one value or one fp32 value per KV head."""
    return (x.float() * per_head(1.0 / scale)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


LayerScale = float | tuple[float, ...]  # a layer's K (or V) cache scale: one, or one per KV head


@dataclass(frozen=True)
class KVScales:
    """A checkpoint's FP8 cache scales, an entry per layer: layer i stores K / k[i] and V / v[i], where an
    entry is one value (per tensor) or a tuple of one per KV head (compressed-tensors' "attn_head"
    strategy; `models.quant.take_kv_scales` reads them). Calibrated scales keep large K and V from
    saturating at +-448 and small ones in e4m3's normal range; per head, a head of small values is not
    pushed below that range by another head's large ones."""

    k: tuple[LayerScale, ...]
    v: tuple[LayerScale, ...]

    def values(self) -> list[float]:
        """Every scale, K's then V's."""
        return [x for entry in self.k + self.v for x in (entry if isinstance(entry, tuple) else (entry,))]

    def heads(self, first: int, count: int) -> KVScales:
        """The scales of KV heads first..first + count - 1 (a tensor-parallel rank's): per-head entries cut,
        per-tensor ones as they are."""
        def cut(entry: LayerScale) -> LayerScale:
            return entry[first : first + count] if isinstance(entry, tuple) else entry
        return KVScales(tuple(map(cut, self.k)), tuple(map(cut, self.v)))


class OutOfSlots(RuntimeError):
    """No free slot: the scheduler must queue the request."""


class PageTable:
    """Slots and the pages that hold their positions, shared by every cache of the engine (the target's
    and the drafter's use the same page ids). The host decides (`reserve`, `release`); `sync` copies
    the entries that changed to the device table in one transfer before the step's forwards."""

    def __init__(self, max_slots: int, max_len: int, page_size: int, num_pages: int,
                 device: torch.device | str) -> None:
        if page_size < 1 or num_pages < 1:
            raise ConfigError(f"page_size and num_pages must be >= 1, got {page_size} and {num_pages}")
        self.max_slots = max_slots
        self.max_len = max_len
        self.page_size = page_size
        self.num_pages = num_pages
        self.trash_page = num_pages
        self.scratch_slot = max_slots  # padded requests of captured batches: every entry is trash
        self.columns = self.columns_for(max_len, page_size)
        self.table = torch.full((max_slots + 1, self.columns), num_pages, dtype=torch.int32, device=device)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._held: list[list[int]] = [[] for _ in range(max_slots)]
        self._dirty: dict[tuple[int, int], int] = {}
        self.prefix: PrefixCache | None = None

    def enable_prefix_caching(self) -> None:
        """Remember full pages by their tokens for later prompts (`PrefixCache`)."""
        if _SHARED.get() is not None:
            raise ConfigError("enable_prefix_caching: engines that take turns on one KV store overwrite each "
                              "other's pages, so none can remember them")
        self.prefix = PrefixCache(self.page_size)

    @classmethod
    def full(cls, max_slots: int, max_len: int, device: torch.device | str,
             page_size: int = DEFAULT_PAGE_SIZE) -> PageTable:
        """A table whose every slot holds pages for all its positions (a standalone cache: the models'
        tests, the trainer's scoring). Pages go to the slots in turn, so a slot's pages are never
        adjacent: whatever runs on it runs on scattered pages, as in the engine."""
        table = cls(max_slots, max_len, page_size, max_slots * cls.columns_for(max_len, page_size), device)
        for col in range(table.columns):
            for slot in range(max_slots):
                table.reserve(slot, (col + 1) * page_size)
        table.sync()
        return table

    @staticmethod
    def columns_for(max_len: int, page_size: int) -> int:
        """Pages a slot of `max_len` positions spans: positions 0..max_len (max_len: the trash position)."""
        return max_len // page_size + 1

    @staticmethod
    def pages_for(tokens: int, page_size: int) -> int:
        return -(-tokens // page_size)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_free_pages(self) -> int:
        """Pages a reservation may take: the free ones and the remembered ones no slot holds."""
        return len(self._free_pages) + (len(self.prefix.idle) if self.prefix else 0)

    def held(self, slot: int) -> int:
        """Pages `slot` holds."""
        return len(self._held[slot])

    def allocate(self) -> int:
        if not self._free_slots:
            raise OutOfSlots("no free KV slot")
        return self._free_slots.pop()

    def missing(self, slot: int, tokens: int) -> int:
        """Pages `slot` lacks to hold positions 0..tokens-1 (capped at the table's extent)."""
        want = self.pages_for(min(tokens, self.columns * self.page_size), self.page_size)
        return max(0, want - len(self._held[slot]))

    def reserve(self, slot: int, tokens: int) -> bool:
        """Give `slot` pages for positions 0..tokens-1; False (and nothing taken) if too few are free."""
        n = self.missing(slot, tokens)
        if n > self.num_free_pages:
            return False
        pages = self._held[slot]
        for _ in range(n):
            page = self._free_pages.pop() if self._free_pages else self.prefix.evict()
            self._dirty[(slot, len(pages))] = page
            pages.append(page)
        return True

    def share(self, slot: int, pages: list[int]) -> None:
        """Map remembered pages (`PrefixCache.lookup`) into the slot's columns after those it holds."""
        held = self._held[slot]
        for page in pages:
            self.prefix.hold(page)
            self._dirty[(slot, len(held))] = page
            held.append(page)

    def shared_columns(self, slot: int, pages: list[int]) -> int:
        """How many of the slot's first columns hold `pages`' first pages."""
        held = self._held[slot]
        return next((i for i, (a, b) in enumerate(zip(held, pages)) if a != b), min(len(held), len(pages)))

    def remember(self, slot: int, tokens: list[int], final: int, draft_final: int, salt: str | None = None) -> None:
        """The slot's full pages within its first `final` positions hold final K/V of `tokens` (within
        `draft_final`, the drafter's context too): remember them, under `salt` (`PrefixCache`)."""
        if self.prefix is not None:
            self._free_pages.extend(self.prefix.insert(self._held[slot], tokens, final, draft_final, salt))

    def forget_prefixes(self) -> None:
        """Forget every remembered page: idle ones are free, held ones stay with their holders."""
        self._free_pages.extend(self.prefix.forget_all())

    def truncate(self, slot: int, columns: int) -> None:
        """The slot lets go of its pages from column `columns` on: all of them at its release; before it
        has run, those it will compute itself or share anew (`Scheduler.share_more`)."""
        pages = self._held[slot]
        for col in range(columns, len(pages)):
            self._dirty[(slot, col)] = self.trash_page
        dropped, self._held[slot] = pages[columns:], pages[:columns]
        self._free_pages.extend(self.prefix.drop(reversed(dropped)) if self.prefix else reversed(dropped))

    def release(self, slot: int) -> None:
        """Free a slot and its pages; its entries point to the trash page again (a padded row of a
        later batch writing this slot's trash position must not land in a page someone else holds)."""
        if slot in self._free_slots:
            raise ValueError(f"slot {slot} released twice")
        self.truncate(slot, 0)
        self._free_slots.append(slot)

    def sync(self) -> None:
        """Copy the entries changed since the last sync to the device table (one transfer, one scatter;
        ordered on the stream after every forward already launched, which still sees the old ones)."""
        if not self._dirty:
            return
        (slots, cols), pages = zip(*self._dirty), list(self._dirty.values())
        self._dirty.clear()
        idx = to_device([list(slots), list(cols), pages], torch.int64, self.table.device)
        self.table[idx[0], idx[1]] = idx[2].to(torch.int32)


class PrefixCache:
    """Full pages remembered by content: a page's key is its tokens and the key of the page before it
    (exact, so two prompts share a page only if every token up to its end agrees); a first page's "page
    before" is the request's cache salt (vLLM's `cache_salt`), so requests of different salts share
    nothing and a tenant cannot time another's prompts through cache hits. A page may hold the
    target's K/V alone (written by a request that fed no drafter) or the drafter's context too (`draft`):
    a request that will draft can use only the latter. Pages in use count their holders; a remembered
    page no slot holds is idle, evicted least recently used first when a reservation finds no free
    page. Counts of the tokens looked up and found feed the engine's stats."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        # (id of the page before, or the salt for a first page, tokens) -> page
        self.page_of: dict[tuple[int | str | None, tuple[int, ...]], int] = {}
        self.key_of: dict[int, tuple[int | str | None, tuple[int, ...]]] = {}
        self.node: dict[int, int] = {}  # page -> its key's id (what the next page's key starts with)
        self.draft: set[int] = set()  # remembered pages that hold the drafter's context too
        self.holders: Counter[int] = Counter()
        self.orphans: Counter[int] = Counter()  # pages whose key went to a better copy while slots held them
        self.idle: OrderedDict[int, None] = OrderedDict()  # remembered, held by no slot; oldest first
        self._ids = 0
        self.queried_tokens = 0
        self.hit_tokens = 0

    def lookup(self, tokens: list[int], limit: int, salt: str | None = None) -> list[int]:
        """The remembered pages that hold `tokens` from position 0 under `salt`, over at most `limit` positions."""
        pages: list[int] = []
        parent: int | str | None = salt
        for start in range(0, limit - self.page_size + 1, self.page_size):
            page = self.page_of.get((parent, tuple(tokens[start:start + self.page_size])))
            if page is None:
                break
            pages.append(page)
            parent = self.node[page]
        return pages

    def with_draft(self, pages: list[int]) -> int:
        """How many of `pages`, from the first, hold the drafter's context too."""
        return next((i for i, page in enumerate(pages) if page not in self.draft), len(pages))

    def count(self, queried: int, hit: int) -> None:
        """An admitted request looked up `queried` positions and found `hit` of them."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def hold(self, page: int) -> None:
        self.holders[page] += 1
        self.idle.pop(page, None)

    def insert(self, pages: list[int], tokens: list[int], final: int, draft_final: int,
               salt: str | None = None) -> list[int]:
        """Remember `pages` (a slot's, in position order) whose positions below `final` hold tokens' K/V, and
        below `draft_final` the drafter's context too, under `salt`; returns the pages this frees. A page whose
        key another page has stays unremembered (its holder keeps it to itself), unless it holds the drafter's context
        and the other does not: then the key moves to it, and the other is freed (or when its holders let
        go: an orphan, which takes its key back if the page that took it is gone)."""
        parent: int | str | None = salt
        size, freed = self.page_size, []
        for col in range(min(final // size, len(pages))):
            page, with_draft = pages[col], (col + 1) * size <= draft_final
            if page in self.key_of:  # remembered before, maybe since then given the drafter's context
                if with_draft:
                    self.draft.add(page)
                parent = self.node[page]
                continue
            key = (parent, tuple(tokens[col * size:(col + 1) * size]))
            other = self.page_of.get(key)
            if other is not None and (other in self.draft or not with_draft or page in self.orphans):
                parent = self.node[other]  # computed twice (requests that prefilled it side by side)
                continue
            if other is not None:
                self._forget(other)
                if other in self.holders:
                    self.orphans[other] = self.holders.pop(other)
                else:
                    freed.append(other)
            self.page_of[key], self.key_of[page], self.node[page] = page, key, self._ids
            self._ids += 1
            self.holders[page] = self.orphans.pop(page, 1)  # its holders: the slot that wrote it, or an orphan's
            if with_draft:
                self.draft.add(page)
            parent = self.node[page]
        return freed

    def drop(self, pages: Iterable[int]) -> list[int]:
        """A slot lets go of `pages`: those it alone held and nobody remembers are free (returned); a
        remembered one becomes idle."""
        free = []
        for page in pages:
            if page in self.orphans:
                self.orphans[page] -= 1
                if self.orphans[page] == 0:
                    del self.orphans[page]
                    free.append(page)
            elif page not in self.key_of:
                free.append(page)
            else:
                self.holders[page] -= 1
                if self.holders[page] == 0:
                    del self.holders[page]
                    self.idle[page] = None
        return free

    def evict(self) -> int:
        """The least recently idle page, forgotten (pages keyed after it can no longer be reached)."""
        page, _ = self.idle.popitem(last=False)
        self._forget(page)
        return page

    def forget_all(self) -> list[int]:
        """Forget every key; returns the idle pages, now free (held ones become orphans)."""
        idle = list(self.idle)
        for page in list(self.key_of):
            if page in self.holders:
                self.orphans[page] += self.holders.pop(page)
            self._forget(page)
        return idle

    def _forget(self, page: int) -> None:
        del self.page_of[self.key_of.pop(page)], self.node[page]
        self.draft.discard(page)
        self.idle.pop(page, None)


class SharedKVStore:
    """K/V tensors that the caches of engines taking turns reuse: a benchmark point's engines run one at
    a time and each of their passes ends with no request holding a page, so none reads another's
    entries, and the point needs one engine's KV memory, not one per engine. Under `engine()`, an
    engine's n-th cache of a given layer count, shape, dtype and device takes the tensors an earlier
    engine's n-th cache of the same took (zeroed, as a new cache's are); anything else gets its own."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._made: Counter[tuple] = Counter()  # this engine's caches so far, by kind

    @contextlib.contextmanager
    def engine(self) -> Iterator[None]:
        """Build one engine's caches inside: they draw on this store, counted from the first."""
        self._made = Counter()
        token = _SHARED.set(self)
        try:
            yield
        finally:
            _SHARED.reset(token)

    def take(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
             ) -> tuple[Tensor, Tensor]:
        """K and V, each [layers, *shape]."""
        kind = (layers, shape, dtype, device)
        key = (*kind, self._made[kind])
        self._made[kind] += 1
        if key in self.tensors:
            k, v = self.tensors[key]
            k.zero_()
            v.zero_()
        else:
            k, v = (torch.zeros((layers, *shape), dtype=dtype, device=device) for _ in range(2))
            self.tensors[key] = (k, v)
        return k, v

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, v in self.tensors.values() for t in (k, v))


_SHARED: ContextVar[SharedKVStore | None] = ContextVar("shared_kv_store", default=None)


class KVCache:
    """One model's K/V pools over a shared `PageTable`; `max_len` is this cache's positions per slot
    (the trash position), at most the table's. An int `table` is a number of slots that hold all their
    pages (`PageTable.full`): a standalone cache."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str, table: PageTable | int, kv_dtype: torch.dtype | None = None,
                 k_scale: float | Sequence[LayerScale] = 1.0, v_scale: float | Sequence[LayerScale] = 1.0) -> None:
        if isinstance(table, int):
            table = PageTable.full(table, max_len, device)
        if max_len > table.max_len:
            raise ValueError(f"a cache of {max_len} positions needs a page table of at least that many "
                             f"({table.max_len})")
        shape = (table.num_pages + 1, num_kv_heads, table.page_size, head_dim)
        store = kv_dtype or dtype
        if store not in (dtype, FP8):
            raise ValueError(f"a KV cache stores the model's dtype or float8_e4m3fn, not {store}")
        shared = _SHARED.get()
        if shared is None:
            self.k_layers, self.v_layers = (torch.zeros((num_layers, *shape), dtype=store, device=device)
                                            for _ in range(2))
        else:
            self.k_layers, self.v_layers = shared.take(num_layers, shape, store, torch.device(device))
        # each layer's pool is a view of one tensor of every layer's: a drafter's context is gathered and
        # appended for all its layers at once (`gather_layers`, `write_layers`)
        self.k, self.v = list(self.k_layers.unbind(0)), list(self.v_layers.unbind(0))
        self.dtype = dtype  # what attention computes in
        self.quantized = store == FP8
        # each layer's scales (an unquantized cache stores K and V as they are): floats, or [kv_heads] fp32
        # tensors for both K and V where either is per head (the kernels take both one way or the other)
        k_scales = per_layer(k_scale if self.quantized else 1.0, num_layers, num_kv_heads, "k_scale")
        v_scales = per_layer(v_scale if self.quantized else 1.0, num_layers, num_kv_heads, "v_scale")
        pairs = [(k, v) if isinstance(k, float) and isinstance(v, float) else
                 tuple(torch.tensor(x if isinstance(x, tuple) else (x,) * num_kv_heads, dtype=torch.float32,
                                    device=device) for x in (k, v))
                 for k, v in zip(k_scales, v_scales)]
        self.k_scales: tuple[float | Tensor, ...] = tuple(k for k, _ in pairs)
        self.v_scales: tuple[float | Tensor, ...] = tuple(v for _, v in pairs)
        self.pages = table
        self.max_len = max_len
        self.trash = max_len
        self.scratch_slot = table.scratch_slot

    @property
    def table(self) -> Tensor:
        return self.pages.table

    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype) -> int:
        """Bytes one page of every layer's K and V takes."""
        return 2 * num_layers * num_kv_heads * page_size * head_dim * dtype.itemsize

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_layers, self.v_layers))

    def _locate(self, slots: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """(page, offset in the page) of each (slot, position); slots broadcast against positions."""
        p = self.pages.page_size
        return self.table[slots, positions // p].long(), positions % p

    def write(self, layer: int, meta: "AttnMeta", k: Tensor, v: Tensor) -> None:
        """k, v: [R, kv_heads, Q, hd], stored at (slot, write_pos) for every query row."""
        page, offset = self._locate(meta.slots[:, None], meta.write_pos)
        if self.quantized:
            k, v = quantize_kv(k, self.k_scales[layer]), quantize_kv(v, self.v_scales[layer])
        self.k[layer][page, :, offset] = k.transpose(1, 2)
        self.v[layer][page, :, offset] = v.transpose(1, 2)

    def write_layers(self, meta: "AttnMeta", k: Tensor, v: Tensor) -> None:
        """`write` of every layer at once: k, v [layers, R, kv_heads, Q, hd]."""
        page, offset = self._locate(meta.slots[:, None], meta.write_pos)
        if self.quantized:
            k = torch.stack([quantize_kv(k[i], self.k_scales[i]) for i in range(len(k))])
            v = torch.stack([quantize_kv(v[i], self.v_scales[i]) for i in range(len(v))])
        # (page, offset) [R, Q] index dims 1 and 3 around the heads' slice: the indexed view is [R, Q, layers, heads, hd]
        self.k_layers[:, page, :, offset] = k.permute(1, 3, 0, 2, 4)
        self.v_layers[:, page, :, offset] = v.permute(1, 3, 0, 2, 4)

    def gather_layers(self, slots: Tensor, kv_len: int, room: int) -> tuple[Tensor, Tensor]:
        """Every layer's keys and values of positions 0..kv_len-1 of each slot, in one gather, followed by at least
        `room` positions the caller fills: [layers, R, kv_heads, >= kv_len + room, hd] (a copy in the attention's
        dtype; what follows position kv_len - 1 is undefined until written)."""
        p = self.pages.page_size
        cols = self.pages.pages_for(kv_len, p)
        r = slots.shape[0]
        pages = self.table[slots, :cols].long().reshape(-1)

        def pool(t: Tensor, scales: tuple[float | Tensor, ...]) -> Tensor:
            x = t.index_select(1, pages)  # [L, R * cols, H, P, hd]
            layers, _, h, _, d = x.shape
            x = x.view(layers, r, cols, h, p, d).transpose(2, 3)  # [L, R, H, cols, P, hd]
            out = torch.empty(layers, x.shape[1], h, cols * p + room, d, dtype=self.dtype, device=t.device)
            out[:, :, :, : cols * p].view(x.shape).copy_(x)
            if self.quantized:
                for layer, scale in enumerate(scales):
                    out[layer, :, :, :kv_len] *= per_head(scale)
            return out

        return pool(self.k_layers, self.k_scales), pool(self.v_layers, self.v_scales)

    def gather(self, layer: int, slots: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        """Keys and values of positions 0..kv_len-1 of each slot: [R, kv_heads, kv_len, hd] (a copy)."""
        cols = self.pages.pages_for(kv_len, self.pages.page_size)
        pages = self.table[slots, :cols].long()  # [R, cols]

        def pool(t: Tensor, scale: float | Tensor) -> Tensor:
            # index_select, not t[pages]: the same copy, at a half to a third of the CPU time
            x = t.index_select(0, pages.reshape(-1)).view(*pages.shape, *t.shape[1:])  # [R, cols, H, P, hd]
            r, _, h, p, d = x.shape
            x = x.transpose(1, 2).reshape(r, h, cols * p, d)[:, :, :kv_len]
            return (x.float() * per_head(scale)).to(self.dtype) if self.quantized else x

        return pool(self.k[layer], self.k_scales[layer]), pool(self.v[layer], self.v_scales[layer])

    def read(self, layer: int, meta: "AttnMeta") -> tuple[Tensor, Tensor]:
        """Keys and values of the first kv_len positions of each request's slot: [R, kv_heads, kv_len, hd]."""
        return self.gather(layer, meta.slots, meta.kv_len)


def per_layer(scale: float | Sequence[LayerScale], num_layers: int, num_kv_heads: int,
              what: str) -> tuple[LayerScale, ...]:
    """A scale for every layer, from one value or an entry per layer (a value, or a tuple of one per KV head)."""
    if isinstance(scale, (int, float)):
        return (float(scale),) * num_layers
    scales = tuple(tuple(map(float, x)) if isinstance(x, (tuple, list)) else float(x) for x in scale)
    if len(scales) != num_layers:
        raise ValueError(f"KVCache: {len(scales)} {what} values for {num_layers} layers")
    for i, x in enumerate(scales):
        if isinstance(x, tuple) and len(x) != num_kv_heads:
            raise ValueError(f"KVCache: layer {i}'s {what} has {len(x)} values for {num_kv_heads} KV heads")
    return scales


@dataclass
class AttnMeta:
    """Where each query row sits: its slot, RoPE position, cache column, and which keys it sees.

    `bounds[layer_type]` = (lo, hi) [R, Q]: query row i of request r attends to key positions
    lo..hi (inclusive) of its slot. The attention kernel reads them directly; the reference path
    turns them into a boolean mask (`mask`)."""

    slots: Tensor  # [R] int64
    positions: Tensor  # [R, Q] int64, absolute positions (RoPE)
    write_pos: Tensor  # [R, Q] int64, cache column (trash column for padding rows)
    kv_len: int  # keys read per request
    bounds: dict[str, tuple[Tensor, Tensor]]

    def mask(self, layer_type: str) -> Tensor:
        """[R, 1, Q, kv_len] bool keep-mask of `bounds[layer_type]`."""
        lo, hi = self.bounds[layer_type]
        return range_mask(lo, hi, torch.arange(self.kv_len, device=lo.device)).unsqueeze(1)


def range_mask(lo: Tensor, hi: Tensor, key_pos: Tensor) -> Tensor:
    """[..., Q, L] bool: key_pos[..., L] lies within lo..hi [..., Q] (inclusive)."""
    k = key_pos.unsqueeze(-2)
    return (k >= lo.unsqueeze(-1)) & (k <= hi.unsqueeze(-1))


def causal_bounds(positions: Tensor, sliding_window: int | None, layer_types: tuple[str, ...]
                  ) -> dict[str, tuple[Tensor, Tensor]]:
    """Each row sees keys up to its own position; sliding layers only the last `sliding_window`.
    Made once per forward as contiguous int32, the kernel's format, so no layer converts them."""
    hi = positions.to(torch.int32).contiguous()
    bounds = {"full_attention": (torch.zeros_like(hi), hi)}
    if "sliding_attention" in layer_types:
        assert sliding_window is not None
        bounds["sliding_attention"] = ((hi - sliding_window + 1).clamp_(min=0), hi)
    return bounds


def causal_meta(
    slots: list[int],
    starts: list[int],
    q_lens: list[int],
    num_queries: int,
    trash: int,
    device: torch.device | str,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
    kv_len: int | None = None,
) -> AttnMeta:
    """Metadata for a causal forward: request r feeds q_lens[r] tokens at positions starts[r], ... .

    Host lists in, device tensors out: the engine knows every length on the host, so this needs no
    sync.
    """
    kv_len = kv_len or max(s + q for s, q in zip(starts, q_lens))
    as_t = lambda v: to_device(v, torch.int64, device)  # noqa: E731
    return meta_from_tensors(as_t(slots), as_t(starts), as_t(q_lens), num_queries, kv_len, trash, sliding_window,
                             layer_types)


def meta_from_tensors(
    slots: Tensor,
    starts: Tensor,
    q_lens: Tensor,
    num_queries: int,
    kv_len: int,
    trash: int,
    sliding_window: int | None = None,
    layer_types: tuple[str, ...] = ("full_attention",),
) -> AttnMeta:
    """Device-only metadata (CUDA-graph capturable): query i of request r sits at starts[r] + i and
    sees keys at positions <= its own (its cache plus earlier rows of this forward); rows
    i >= q_lens[r] are padding whose K/V go to the trash column.
    """
    ar = torch.arange(num_queries, device=starts.device)
    valid = ar[None, :] < q_lens[:, None]
    # padding rows sit at their request's start: in range of the RoPE table however wide the batch is
    positions = torch.where(valid, starts[:, None] + ar[None, :], starts[:, None])
    write_pos = torch.where(valid, positions, torch.full_like(positions, trash))
    return AttnMeta(slots, positions, write_pos, kv_len, causal_bounds(positions, sliding_window, layer_types))


def dense_causal_meta(batch: int, seq: int, device: torch.device | str, sliding_window: int | None = None,
                      layer_types: tuple[str, ...] = ("full_attention",)) -> AttnMeta:
    """Metadata for a cache-free causal forward over [batch, seq] tokens at positions 0..seq-1."""
    positions = torch.arange(seq, device=device).expand(batch, seq)
    slots = torch.zeros(batch, dtype=torch.int64, device=device)
    return AttnMeta(slots, positions, positions, seq, causal_bounds(positions, sliding_window, layer_types))
