"""What every attention backend is: a decode part and a prefill part, and how the two share one step.

`AttentionBackend.prepare` turns the step's neutral batch (`sage_infer.core.step_batch.StepBatch`) into its
`AttentionMetadata`: which rows are decode rows (the decode part groups them: `DecodePart.groups`), which are
prefill spans (the prefill part says how they read earlier context: `PrefillPart.prepare`), and which attend a
shared prefix together. `AttentionBackend.forward` is one layer's attention over that metadata. A part is one
file of this package and one line of its registry (`sage_infer.layers.attention_backends`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from sage_infer.core.step_batch import SeqSpan, StepBatch
from sage_infer.layers.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    SharedPrefix,
    decode_groups,
    merge_attention,
)
from sage_infer.layers.attention_kinds import (
    FULL_ATTENTION,
    AttentionKind,
    kind_decode_attention,
    kind_prefill_attention,
    window_tables,
)

if TYPE_CHECKING:
    from sage_infer.kv_runtime.pool import KVPool

DECODE_GROUP_ROWS = 16  # gathered decode rows are sorted by context length and padded per group of this size
# with a decode part that reads blocks in place (and a prefill part that does not), a prefill chunk of at most this
# many tokens after cached context (a turn of a chat, a prompt's unique tail after a shared prefix) is attended as
# that many decode rows: each reads its causal context in place instead of a gathered copy per span
IN_PLACE_CHUNK_ROWS = 64
# ... unless the prefill part is the flash kernel, the chunk has more than IN_PLACE_MIN_ROWS rows and its rows times
# its context exceed IN_PLACE_CHUNK_PAIRS (query, key) pairs: the decode kernel reads every key once per row, the
# flash kernel once per tile of rows (but runs in the per-layer loop, not the one-call C++ decode step). A chunk's
# TTFT after 1-16K cached tokens (`qwen3-11m`, fp32 and bf16, also at a forced avx2 level; quiet Xeon VM, both
# routes alternating in one process) crossed over at 24 rows x 2K, 12 x 4K, 8 x 8K, 6-8 x 16K: flash was 1.5-1.7x
# faster at 16 x 16K and 1.6-2.4x at 32-64 x 4K, decode rows up to 1.4x faster for a few rows over a long context
IN_PLACE_MIN_ROWS = 6
IN_PLACE_CHUNK_PAIRS = 48 * 1024


@dataclass(frozen=True)
class DecodePart:
    """How decode rows attend: `attend` (and `attend_lse` for a shared prefix's suffixes) over one `DecodeGroup`.

    `in_place`: it reads each row's blocks in place, so padding costs nothing and all rows are one group; short
    chunks after cached context become decode rows (`IN_PLACE_CHUNK_ROWS`, `IN_PLACE_CHUNK_PAIRS`)."""

    name: ClassVar[str]
    in_place: ClassVar[bool] = False
    group_rows: ClassVar[int] = DECODE_GROUP_ROWS

    def groups(self, rows: list[int], tables: list[list[int]], lens: list[int], batch: StepBatch) -> list[DecodeGroup]:
        """The decode rows of a step (their block tables, their context lengths) as this part's groups."""
        return decode_groups(rows, tables, lens, batch.tensor, self.group_rows)

    def attend(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float) -> torch.Tensor:
        """q: [b, H, D] -> [b, H, D] in q's dtype."""
        raise NotImplementedError

    def attend_lse(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's suffixes: q: [b, H, D] -> (out [b, H, D] float32, lse [b, H])."""
        raise NotImplementedError

    def declines(self, kind: AttentionKind, device: torch.device, block_size: int) -> str | None:
        """None when `attend_kind` runs rows of a layer of `kind` (not plain) on `device` with blocks of
        `block_size`, else why not (they then attend through PyTorch: `AttentionBackend.forward_kind`)."""
        return "the gathered decode part is the PyTorch oracle"

    def attend_kind(self, q: torch.Tensor, pool: KVPool, layer: int, group: DecodeGroup, scale: float,
                    kind: AttentionKind) -> torch.Tensor:
        """Rows of a layer of `kind` (one `declines` does not): q: [b, H, D] -> [b, H, D] in q's dtype."""
        raise NotImplementedError


@dataclass(frozen=True)
class PrefillPart:
    """How prefill spans attend. This base attends them one by one over their context (this step's keys, or
    gathered from the pool by slot), through `attend`; shared prefixes and their suffixes through `prefix_lse`
    and `attend_lse`. A part that reads blocks in place overrides `prepare` and `attend_spans`.

    `flash`: a flash kernel, reading every key once per tile of query rows (`IN_PLACE_CHUNK_PAIRS`);
    `sage_flash_prefix`: the C++ decode step attends a shared prefix with sage's flash kernel, as this part does
    (else with PyTorch's)."""

    name: ClassVar[str]
    in_place: ClassVar[bool] = False
    flash: ClassVar[bool] = False
    sage_flash_prefix: ClassVar[bool] = False
    supports_cascade: ClassVar[bool] = True  # shared prefixes attended once by all their sequences (`SharedPrefix`)

    def prepare(self, batch: StepBatch, spans: list[SeqSpan],
                suffixes: list[tuple[int, SeqSpan]]) -> tuple[list[PrefillSpan], object | None, list[PrefillSpan]]:
        """(the step's prefill spans, how they read earlier context, the shared prefix's suffix spans).

        `suffixes`: (first row among the shared prefix's participants, span) of each participant's chunk that is
        not decode rows. Only spans with earlier context read keys back from the pool: their slots are gathered,
        a suffix's from the end of the shared prefix."""
        slots: list[int] = []
        prefills = []
        for span in spans:
            prefills.append(PrefillSpan(span.q_start, span.q_len, span.context_len, len(slots)))
            if span.start > 0:
                slots.extend(batch.slots(span.block_table, 0, span.context_len))
        shared_tokens = batch.shared_tokens
        shared = []
        for row, span in suffixes:
            shared.append(PrefillSpan(row, span.q_len, span.context_len - shared_tokens, len(slots)))
            if span.start > shared_tokens:
                slots.extend(batch.slots(span.block_table, shared_tokens, span.context_len))
        return prefills, batch.tensor(slots) if slots else None, shared

    def attend_spans(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                     meta: AttentionMetadata, out: torch.Tensor, scale: float,
                     kind: AttentionKind = FULL_ATTENTION) -> None:
        """Every span of `meta.prefills` into `out` (q's rows, q's dtype). A part in place that takes `kind` (not
        plain) attends every span under it here too (`AttentionBackend.forward_kind`); this one only plain spans."""
        assert kind.plain, "spans of a layer of another kind attend one by one (AttentionBackend.forward_kind)"
        for span in meta.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:  # nothing cached before: the keys are this step's own
                k_ctx, v_ctx = k[rows], v[rows]
            else:
                slots = meta.prefill_context[span.slot_start : span.slot_start + span.context_len]
                if (done := self.attend_in_pool(q[rows], pool, layer, slots, scale, kind)) is not None:
                    out[rows] = done
                    continue
                k_ctx, v_ctx = pool.gather_slots(layer, slots, q.dtype)
            out[rows] = self.attend(q[rows], k_ctx, v_ctx, scale)

    def attend_in_pool(self, q: torch.Tensor, pool: KVPool, layer: int, slots: torch.Tensor, scale: float,
                       kind: AttentionKind) -> torch.Tensor | None:
        """One span (q's rows, causal to the lower right) whose context is the pool's rows `slots` of `layer`, read
        in place where this part's kernel can (q's dtype); None where it cannot: the caller gathers the context
        and calls `attend` / `attend_kind`."""
        got = self.lse_in_pool(q, pool, layer, slots, scale, kind)
        return None if got is None else got[0].to(q.dtype)

    def lse_in_pool(self, q: torch.Tensor, pool: KVPool, layer: int, slots: torch.Tensor, scale: float,
                    kind: AttentionKind = FULL_ATTENTION, causal: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`attend_in_pool`'s (out, lse) in float32, causal or not (a shared prefix's keys); None where this part
        reads no context in place."""
        return None

    def span_context(self, pool: KVPool, layer: int, meta: AttentionMetadata, index: int, span: PrefillSpan,
                     dtype: torch.dtype, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [context_len - start, KvH, D] of the `index`-th span of `meta.prefills` (one with earlier context)
        from its token `start` on, as copies (the layers whose kind no kernel runs read them:
        `AttentionBackend.forward_kind`)."""
        return pool.gather_slots(layer, self.span_slots(meta, span, start), dtype)

    @staticmethod
    def span_slots(meta: AttentionMetadata, span: PrefillSpan, start: int = 0) -> torch.Tensor:
        """The slots of a span's context (one with earlier context) from its token `start` on."""
        return meta.prefill_context[span.slot_start + start : span.slot_start + span.context_len]

    def attend(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float) -> torch.Tensor:
        """One span, causal to the lower right: q [q_len, H, D]; k/v [ctx_len, KvH, D] -> q's dtype."""
        raise NotImplementedError

    def declines(self, kind: AttentionKind, device: torch.device) -> str | None:
        """None when `attend_kind` runs spans of a layer of `kind` (not plain) on `device`, else why not (they
        then attend through PyTorch: `AttentionBackend.forward_kind`)."""
        return f"the {self.name} prefill part's kernel takes no sliding window, soft-cap or sinks"

    def attend_kind(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, scale: float,
                    kind: AttentionKind) -> torch.Tensor:
        """`attend` under `kind` (one `declines` does not): q's dtype."""
        raise NotImplementedError

    def attend_lse(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """A shared prefix's suffix span: (out float32, lse), causal to the lower right."""
        raise NotImplementedError

    def prefix_lse(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Every participant's rows over the shared keys, no mask: (out float32, lse)."""
        raise NotImplementedError


@dataclass(slots=True)
class _DecodeRows:
    rows: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)

    def add(self, rows: range, table: list[int], lens: range) -> None:
        self.rows.extend(rows)
        self.tables.extend([table] * len(rows))
        self.lens.extend(lens)


@dataclass(frozen=True)
class AttentionBackend:
    """A decode part and a prefill part; `prepare` shapes a step for them, `forward` is one layer's attention.

    `row_invariant` (`model.deterministic`): every query row, a prefill chunk's too, is a decode row of a part
    that reads blocks in place and reduces each row's context on its own, so a row's attention never depends on
    how its prompt was chunked or what else the step holds; no cascade."""

    decode: DecodePart
    prefill: PrefillPart
    row_invariant: bool = False

    def __post_init__(self) -> None:
        if self.row_invariant and not self.decode.in_place:
            raise ValueError("row-invariant steps need a decode part that reads blocks in place (the paged kernel)")

    @property
    def name(self) -> str:
        return f"decode {self.decode.name}, prefill {self.prefill.name}"

    @property
    def decode_in_place(self) -> bool:
        return self.decode.in_place

    @property
    def prefill_in_place(self) -> bool:
        return self.prefill.in_place

    @property
    def supports_cascade(self) -> bool:
        return self.prefill.supports_cascade and not self.row_invariant

    def _as_decode_rows(self, span: SeqSpan) -> bool:
        """Whether a span's rows attend as decode rows, each its causal context (else: a prefill span)."""
        return span.q_len == 1 or self.row_invariant or (
            self.decode.in_place and not self.prefill.in_place and span.start > 0 and span.q_len <= IN_PLACE_CHUNK_ROWS
            and (not self.prefill.flash or span.q_len <= IN_PLACE_MIN_ROWS
                 or span.q_len * span.context_len <= IN_PLACE_CHUNK_PAIRS))

    def prepare(self, batch: StepBatch) -> AttentionMetadata:
        """The step's metadata for this backend. A span with one new token after others is decode rows; with a
        decode part in place so is a short chunk after cached context; any other chunk is a prefill span. The
        spans of `batch.shared_seqs` go to `AttentionMetadata.shared` with their suffixes."""
        shared_tokens, num_shared = batch.shared_tokens, len(batch.shared_blocks)
        decode, shared_decode = _DecodeRows(), _DecodeRows()
        spans: list[SeqSpan] = []
        suffixes: list[tuple[int, SeqSpan]] = []
        shared_rows: list[int] = []  # participants' query rows, prefill spans' first
        for i, span in enumerate(batch.spans):
            rows = range(span.q_start, span.q_start + span.q_len)
            as_rows = self._as_decode_rows(span)
            if i in batch.shared_seqs:  # the context after the shared blocks is this sequence's suffix
                if as_rows:  # row j of the chunk sees the suffix up to its own token
                    shared_decode.add(rows, span.block_table[num_shared:],
                                      range(span.start + 1 - shared_tokens, span.context_len + 1 - shared_tokens))
                else:
                    suffixes.append((len(shared_rows), span))
                    shared_rows.extend(rows)
            elif as_rows and (span.start > 0 or self.row_invariant):
                decode.add(rows, span.block_table, range(span.start + 1, span.context_len + 1))
            else:
                spans.append(span)
        prefills, context, shared_prefills = self.prefill.prepare(batch, spans, suffixes)
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping, prefills=prefills, prefill_context=context,
                                 decode_groups=self.decode.groups(decode.rows, decode.tables, decode.lens, batch),
                                 backend=self)
        if batch.shared_seqs:
            local = list(range(len(shared_rows), len(shared_rows) + len(shared_decode.rows)))
            meta.shared = SharedPrefix(
                block_ids=batch.tensor(list(batch.shared_blocks)), num_tokens=shared_tokens,
                rows=batch.tensor(shared_rows + shared_decode.rows), prefills=shared_prefills,
                decode_groups=self.decode.groups(local, shared_decode.tables, shared_decode.lens, batch))
        return meta

    def prepare_static_decode(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                              context_lens: torch.Tensor, rows: torch.Tensor) -> AttentionMetadata:
        """A pure decode step over fixed buffers (a CUDA graph's, captured once and replayed): every row one new
        token, all rows one group read in place, so nothing in the metadata depends on the step's lengths.
        slot_mapping, context_lens, rows: [B] long; block_tables: [B, W] long."""
        assert self.decode.in_place, "fixed buffers need a decode part that reads blocks in place"
        group = DecodeGroup(rows=rows, block_tables=block_tables, context_lens=context_lens, whole_batch=True)
        return AttentionMetadata(slot_mapping=slot_mapping, prefills=[], prefill_context=None, decode_groups=[group],
                                 backend=self)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                meta: AttentionMetadata, scale: float, kind: AttentionKind = FULL_ATTENTION) -> torch.Tensor:
        """Store this step's K/V of `layer` in `pool`, then attend. q: [T, H, D]; k, v: [T, KvH, D] -> [T, H, D].
        A layer of another `kind` than plain causal attention runs `forward_kind`."""
        pool.store(layer, k, v, meta.slot_mapping)
        if not kind.plain:
            return self.forward_kind(q, k, v, pool, layer, meta, scale, kind)
        if (group := meta.pure_decode_group()) is not None:  # no row gather, no scatter back
            return self.decode.attend(q, pool, layer, group, scale)
        out = torch.empty_like(q)
        if meta.prefills:
            self.prefill.attend_spans(q, k, v, pool, layer, meta, out, scale)
        for group in meta.decode_groups:
            out[group.rows] = self.decode.attend(q[group.rows], pool, layer, group, scale)
        if meta.shared is not None:
            out[meta.shared.rows] = self.cascade(q, k, v, pool, layer, meta, scale).to(q.dtype)
        return out

    def kind_routes(self, kinds: list[AttentionKind], device: torch.device, block_size: int) -> list[str]:
        """How layers of `kinds` (none plain) attend here, for the start-up line: per part, its kernel or PyTorch
        with the reason the part gives (`declines`, the one place a declined kind says why)."""
        routes = []
        for what, declines in (("decode rows", lambda kind: self.decode.declines(kind, device, block_size)),
                               ("prefill spans", lambda kind: self.prefill.declines(kind, device))):
            part = self.decode if what == "decode rows" else self.prefill
            kernel = "flash" if getattr(part, "flash", False) else part.name
            by_reason: dict[str | None, list[str]] = {}
            for kind in kinds:
                names = by_reason.setdefault(declines(kind), [])
                if kind.describe() not in names:
                    names.append(kind.describe())
            for reason, names in by_reason.items():
                which = "" if len(by_reason) == 1 else f" of {' / '.join(names)} layers"
                routes.append(f"{what}{which} through the {kernel} kernel" if reason is None
                              else f"{what}{which} through PyTorch ({reason})")
        return routes

    def forward_kind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                     meta: AttentionMetadata, scale: float, kind: AttentionKind) -> torch.Tensor:
        """A sliding-window, soft-capped or sinks layer (K/V already stored): the step's spans and decode groups as
        this backend prepared them, through each part's kernel where it takes the kind (`declines` says why not),
        else in PyTorch (`sage_infer.layers.attention_kinds`); spans read only the keys their window reaches. The
        engine turns cascade attention off for models with such layers."""
        assert meta.shared is None, "cascade attention attends every shared key: off for windowed/capped layers"
        out = torch.empty_like(q)
        prefill_kernel = self.prefill.declines(kind, q.device) is None
        in_place = prefill_kernel and self.prefill.in_place
        if in_place and meta.prefills:  # every span in one call, its context read in place
            self.prefill.attend_spans(q, k, v, pool, layer, meta, out, scale, kind)
        for index, span in enumerate([] if in_place else meta.prefills):
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:
                k_ctx, v_ctx = k[rows], v[rows]
            else:  # a window reads only the keys its queries see (the mask is relative: the same math)
                start = 0 if kind.window is None else max(0, span.context_len - span.q_len - kind.window + 1)
                if prefill_kernel and (done := self.prefill.attend_in_pool(
                        q[rows], pool, layer, self.prefill.span_slots(meta, span, start), scale, kind)) is not None:
                    out[rows] = done
                    continue
                k_ctx, v_ctx = self.prefill.span_context(pool, layer, meta, index, span, q.dtype, start)
            if prefill_kernel:
                out[rows] = self.prefill.attend_kind(q[rows], k_ctx, v_ctx, scale, kind)
            else:
                out[rows] = kind_prefill_attention(q[rows], k_ctx, v_ctx, scale, kind)
        decode_kernel = self.decode.declines(kind, q.device, pool.block_size) is None
        for group in meta.decode_groups:
            if decode_kernel:
                out[group.rows] = self.decode.attend_kind(q[group.rows], pool, layer, group, scale, kind)
                continue
            tables, lens = group.block_tables, group.context_lens
            if kind.window is not None:
                tables, lens = window_tables(tables, lens, kind.window, pool.block_size)
            keys, values = pool.gather_blocks(layer, tables, q.dtype)
            out[group.rows] = kind_decode_attention(q[group.rows], keys, values, lens, scale, kind)
        return out

    def cascade(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention of the participants of `meta.shared` (K/V of this step already stored).

        q: [T, H, D]; k, v: [T, KvH, D] (this step's) -> [N, H, D] float32 for ``meta.shared.rows``.
        The shared keys are gathered once and attended by all N query rows in one call; each
        participant's suffix is attended as the reference path would (with a lower-right causal
        mask for prefill chunks); the two are merged by their log-sum-exp.
        """
        shared = meta.shared
        q_rows = q[shared.rows]
        got = self.prefill.lse_in_pool(q_rows, pool, layer, pool.block_slots(shared.block_ids), scale, causal=False)
        if got is None:
            keys, values = pool.gather_blocks(layer, shared.block_ids[None], q.dtype)  # [1, num_tokens, KvH, D]
            got = self.prefill.prefix_lse(q_rows, keys[0], values[0], scale)  # before the next gather
        prefix_out, prefix_lse = got
        suffix_out, suffix_lse = torch.empty_like(prefix_out), torch.empty_like(prefix_lse)
        for span in shared.prefills:
            rows = slice(span.q_start, span.q_start + span.q_len)
            if span.context_len == span.q_len:  # the suffix is this step's own tokens
                own = shared.rows[rows]
                k_ctx, v_ctx = k[own], v[own]
            else:
                slots = meta.prefill_context[span.slot_start : span.slot_start + span.context_len]
                if (got := self.prefill.lse_in_pool(q_rows[rows], pool, layer, slots, scale)) is not None:
                    suffix_out[rows], suffix_lse[rows] = got
                    continue
                k_ctx, v_ctx = pool.gather_slots(layer, slots, q.dtype)
            suffix_out[rows], suffix_lse[rows] = self.prefill.attend_lse(q_rows[rows], k_ctx, v_ctx, scale)
        for group in shared.decode_groups:
            suffix_out[group.rows], suffix_lse[group.rows] = self.decode.attend_lse(q_rows[group.rows], pool, layer,
                                                                                    group, scale)
        return merge_attention(prefix_out, prefix_lse, suffix_out, suffix_lse)
