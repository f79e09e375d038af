"""Per-step attention metadata and its builder (the "plan" half of plan/run).

The builder turns per-sequence ``(query_len, context_len)`` and block tables into the index
tensors the kernels read. It can write into persistent buffers (``MetadataBuffers``) so a
captured HIP/CUDA graph sees the new step's values at fixed addresses.

The builder checks the step on the host as it plans it (lengths, block ids, slots, hints) and
records what it established in ``AttentionMetadata.plan``; the layers then check a step built
here against their cache with a few integer comparisons, on a GPU too, without reading the
index tensors back (``step_checks.check_step_metadata``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Sequence

import torch

from . import capabilities
from .layout import as_device
from .validation import check_positive_int, check_written_blocks_once, is_int

__all__ = ["AttentionMetadata", "MetadataBuffers", "PlanBounds", "build_attention_metadata"]


@dataclasses.dataclass(frozen=True)
class PlanBounds:
    """What ``build_attention_metadata`` checked on the host while planning a step.

    Holds for the tensors it built (``tensor_ptrs``: their data pointers, so metadata whose
    index tensors were swapped for others is not taken on trust): ``query_start_loc`` starts
    at 0 and never decreases, ``seq_lens >= query_lens``, every block a sequence uses is in
    ``[0, max_block_id]``, every slot follows the block table (or is -1), positions are in
    ``[0, max_position]``, and the step has ``num_tokens`` real tokens whose longest query
    and sequence are ``max_query_len`` / ``max_seq_len``. -1: none. ``context_tokens``: the
    cached tokens its sequences attend to besides the new ones (an encoder layer has none).

    ``tensors``: the index tensor objects it built, whose types, dtypes, shapes and layout
    it checked on ``device``; the layers skip those checks for metadata holding exactly
    these objects (``step_checks._builder_tensors``).

    ``buffers``: the ``MetadataBuffers`` the step was written into (None: tensors of its own).
    Their next fill overwrites the step's tensors, so the layers refuse the step once another
    was built into them (``MetadataBuffers.check_current``).
    """

    block_size: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_block_id: int
    max_position: int
    tensor_ptrs: tuple[int, ...]
    device: torch.device | None = None
    context_tokens: int = 0  # cached tokens the step's sequences attend to besides their new ones
    tensors: tuple = dataclasses.field(default=(), compare=False, repr=False)
    buffers: "MetadataBuffers | None" = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass
class AttentionMetadata:
    """Index tensors of one step. Tokens are ordered by sequence.

    - ``query_start_loc``: ``[num_seqs + 1]`` int32, prefix sums of query lengths;
    - ``seq_lens``: ``[num_seqs]`` int32, context + new tokens of each sequence;
    - ``block_table``: ``[num_seqs, max_blocks_per_seq]`` int32, cache block of each
      ``block_size`` tokens of a sequence;
    - ``slot_mapping``: ``[num_tokens]`` int64, cache slot of each new token (-1: padding);
    - ``positions``: ``[num_tokens]`` int64, position of each new token (for RoPE).
    ``max_query_len`` / ``max_seq_len`` are host ints (grid sizes); under graph capture
    they are the captured upper bounds. Contract: each is >= the actual longest query /
    sequence of the step (a GPU kernel skips the rows of a query longer than the hint).

    ``block_size`` (keyword, required): the cache block size the block table and slots were
    computed for; a layer whose cache has another block size rejects the step.
    ``plan``: set by ``build_attention_metadata`` (see ``PlanBounds``); None for metadata built
    by hand, whose index tensors are then checked by reading them (on CPU every step, on a
    GPU with ``ROCM_ATTN_CHECK_INDICES=1``). Code that swaps an index tensor of built
    metadata (``dataclasses.replace``) must keep the used entries or pass ``plan=None``.

    The layers check a step once per cache geometry and memoize it on this object: build
    new metadata for each step rather than changing the tensors of one already used.
    """

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    num_decodes: int = 0  # sequences with query_len == 1
    num_prefills: int = 0  # sequences with query_len > 1
    # This step's causality for decoder layers (as the seed's ``attn_metadata.causal``);
    # None: each layer's own value.
    causal: bool | None = None
    block_size: int = dataclasses.field(kw_only=True)
    plan: PlanBounds | None = dataclasses.field(default=None, kw_only=True, repr=False)
    # (what was checked, cache geometry) -> None: the step's checks already passed
    _checked: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __setattr__(self, name, value):
        # A field set anew invalidates the step's memoized checks (and a copy made with
        # copy.copy gets a memo of its own once it changes).
        object.__setattr__(self, name, value)
        if name != "_checked":
            object.__setattr__(self, "_checked", {})

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_OP = "build_attention_metadata"
_MAX_INT32 = 2**31 - 1
_MAX_BLOCK_ID = _MAX_INT32  # the block table is int32


def _check_blocks(s: int, table: Sequence[int], used: int, num_blocks: int | None) -> int:
    """The largest of the first ``used`` block ids of sequence ``s`` (-1: none); each is a
    block id (>= 0) and, when ``num_blocks`` is given, inside the cache."""
    ids = table[:used]
    if not len(ids):
        return -1
    try:
        lo, hi = min(ids), max(ids)
        negative, too_large = lo < 0, hi > _MAX_BLOCK_ID
    except TypeError:  # the message names the entry; the fast path pays nothing for it
        j = next((j for j, b in enumerate(ids) if not is_int(b)), 0)
        raise TypeError(f"{_OP}: block_tables[{s}][{j}] = {ids[j]!r} is not a block id (an int)") from None
    if negative:
        j = list(ids).index(lo)
        raise IndexError(f"{_OP}: block_tables[{s}][{j}] = {lo} is not a block id (block ids are >= 0)")
    if too_large:
        j = list(ids).index(hi)
        raise IndexError(f"{_OP}: block_tables[{s}][{j}] = {hi} is not a block id (block ids are < 2**31: "
                         "the block table is int32)")
    if num_blocks is not None and hi >= num_blocks:
        j = list(ids).index(hi)
        raise IndexError(f"{_OP}: block_tables[{s}][{j}] = {hi} is outside the cache (num_blocks "
                         f"{num_blocks}: valid block ids 0..{num_blocks - 1})")
    return hi


def _host_plan(query_lens: Sequence[int], context_lens: Sequence[int],
               block_tables: Sequence[Sequence[int]], block_size: int,
               padding: Sequence[bool] | None = None, num_blocks: int | None = None):
    capabilities.check_block_size(block_size, _OP)
    for name, per_seq in (("query_lens", query_lens), ("context_lens", context_lens), ("block_tables", block_tables)):
        # a dict or set would be taken by its keys, in any order; a generator has no len()
        if not hasattr(per_seq, "__getitem__") or isinstance(per_seq, (Mapping, str, bytes)):
            raise TypeError(f"{_OP}: {name} must be a sequence with one entry per sequence (a list), got "
                            f"{type(per_seq).__name__} {per_seq!r:.40}")
    if num_blocks is not None and (not is_int(num_blocks) or num_blocks <= 0):
        raise ValueError(f"{_OP}: num_blocks must be a positive int or None, got {num_blocks!r}")
    if not (len(query_lens) == len(context_lens) == len(block_tables)):
        raise ValueError(
            f"{_OP}: query_lens, context_lens and block_tables must have one "
            f"entry per sequence, got {len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    if padding is not None and len(padding) != len(query_lens):
        raise ValueError(f"{_OP}: padding has {len(padding)} entries for {len(query_lens)} sequences")
    if padding is not None:  # a truthy string or number would mark a real sequence as padding
        bad = next((s for s, p in enumerate(padding) if not _is_bool(p)), None)
        if bad is not None:
            raise TypeError(f"{_OP}: padding[{bad}] must be a bool, got {type(padding[bad]).__name__} "
                            f"{padding[bad]!r:.40}")
    qsl = [0]
    seq_lens, slots, positions = [], [], []
    max_block = -1
    for s, (ql, cl, bt) in enumerate(zip(query_lens, context_lens, block_tables)):
        if not (is_int(ql) and is_int(cl)) or ql < 0 or cl < 0:
            raise ValueError(f"{_OP}: sequence {s} has query_len {ql!r}, context_len {cl!r}; both must be "
                             "ints >= 0")
        ql, cl = int(ql), int(cl)
        if not hasattr(bt, "__len__") or isinstance(bt, (str, bytes)):
            raise TypeError(f"{_OP}: block_tables[{s}] must be a sequence of block ids, got "
                            f"{type(bt).__name__} {bt!r:.40}")
        sl = ql + cl
        qsl.append(qsl[-1] + ql)
        if sl > _MAX_INT32 or qsl[-1] > _MAX_INT32:
            raise ValueError(f"{_OP}: sequence {s} has {sl} tokens, the step {qsl[-1]} up to it; at most 2**31 - 1 "
                             "each (seq_lens and query_start_loc are int32)")
        seq_lens.append(sl)
        need = -(-sl // block_size)
        if padding is not None and padding[s]:
            if cl:
                raise ValueError(f"{_OP}: padding sequence {s} has context_len {cl} (must be 0)")
            # Unwritten rows; a one-token padding sequence is a decode that reads its block.
            max_block = max(max_block, _check_blocks(s, bt, need, num_blocks))
            slots += [-1] * ql
            positions += [0] * ql
            continue
        if need > len(bt):
            raise ValueError(
                f"{_OP}: sequence {s} has {sl} tokens and needs {need} blocks of "
                f"{block_size}, but its block table has {len(bt)}"
            )
        max_block = max(max_block, _check_blocks(s, bt, need, num_blocks))
        for p in range(cl, sl):
            positions.append(p)
            slots.append(bt[p // block_size] * block_size + p % block_size)
    return qsl, seq_lens, slots, positions, max_block


def _is_bool(p) -> bool:
    """A Python bool, a numpy bool or a one-element bool tensor."""
    if isinstance(p, torch.Tensor):
        return p.dtype == torch.bool and p.numel() == 1
    # numpy's bool scalar type is ``bool_`` in numpy 1, ``bool`` in numpy 2
    return isinstance(p, bool) or (type(p).__module__ == "numpy" and type(p).__name__ in ("bool_", "bool"))


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str | None = None,
    *,
    num_padded_tokens: int | None = None,
    buffers: "MetadataBuffers | None" = None,
    padding: Sequence[bool] | None = None,
    causal: bool | None = None,
    num_blocks: int | None = None,
) -> AttentionMetadata:
    """Metadata for a batch where sequence s has ``context_lens[s]`` cached tokens and
    ``query_lens[s]`` new ones, stored in the blocks ``block_tables[s]`` of ``block_size``
    tokens each.

    ``device``: where the tensors go (default: the CPU; with ``buffers``, the buffers' device,
    and a ``device`` given must be it).
    ``num_padded_tokens`` pads the token dimension (slot -1, position 0) for a captured
    batch size. With ``buffers``, values are copied into them and views returned.
    ``padding[s]`` marks sequence s as padding rows inside the batch (e.g. the left padding
    of a ``[batch, tokens]`` layout): its tokens write nothing (slot -1, position 0), it has
    no context, and its block table names one readable block (a one-token padding sequence
    is a decode and reads its key there); its attention output rows are unspecified.
    ``causal`` sets the step's causality for decoder layers (None: each layer's own).
    ``num_blocks``: the caches' block count, to reject a block id outside them here (the
    layers check again against their own cache).

    Raises ValueError / IndexError for a bad length, block size or block id, before any
    tensor is built; the returned metadata's ``plan`` records what was checked.
    """
    if device is not None or buffers is None:
        device = as_device("cpu" if device is None else device, _OP)
        if buffers is not None and not _same_device(device, buffers.device):
            raise ValueError(f"{_OP}: device {device} but the buffers are on {buffers.device}; the metadata is "
                             "written into the buffers (pass their device, or none)")
    if buffers is not None and not isinstance(buffers, MetadataBuffers):
        raise TypeError(f"{_OP}: buffers must be a MetadataBuffers or None, got {type(buffers).__name__}")
    qsl, seq_lens, slots, positions, max_block = _host_plan(
        query_lens, context_lens, block_tables, block_size, padding, num_blocks)
    n = len(slots)
    total = n if num_padded_tokens is None else num_padded_tokens
    if not is_int(total) or total < n:
        raise ValueError(f"{_OP}: num_padded_tokens must be an int >= the {n} real tokens, got {total!r}")
    total = int(total)
    if causal is not None and not isinstance(causal, bool):
        raise ValueError(f"{_OP}: causal must be True, False or None, got {causal!r}")
    slots += [-1] * (total - n)
    positions += [0] * (total - n)
    width = max([len(bt) for bt in block_tables] + [1])
    try:
        table = torch.tensor([list(bt) + [0] * (width - len(bt)) for bt in block_tables])
    except (TypeError, RuntimeError, ValueError) as e:  # None, strings, ragged nesting
        raise TypeError(f"{_OP}: block_tables must hold integer block ids (unused entries too; -1 marks none), "
                        f"got {block_tables!r:.80}: {e}") from None
    if table.numel() and (table.is_floating_point() or table.is_complex() or table.dtype == torch.bool):
        raise ValueError(f"{_OP}: block_tables must hold integer block ids, got {table.dtype} values")
    host = dict(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=table.to(torch.int32).reshape(len(block_tables), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
    )
    check_written_blocks_once(_OP, host["slot_mapping"], host["positions"], qsl, seq_lens, host["block_table"],
                              block_size, table_name="block_tables", unread=padding)
    if buffers is not None:
        tensors = buffers.fill(**host)
    else:
        tensors = {k: v.to(device, non_blocking=True) for k, v in host.items()}
    query_lens = [b - a for a, b in zip(qsl, qsl[1:])]  # host ints
    max_query_len, max_seq_len = max(query_lens, default=0), max(seq_lens, default=0)
    device = tensors["query_start_loc"].device
    plan = PlanBounds(
        block_size=block_size, num_tokens=n, max_query_len=max_query_len, max_seq_len=max_seq_len,
        max_block_id=max_block, max_position=max(positions, default=-1),
        tensor_ptrs=plan_tensor_ptrs(tensors), device=device, context_tokens=sum(seq_lens) - qsl[-1],
        tensors=tuple(tensors[name] for name in _INDEX_NAMES), buffers=buffers,
    )
    md = AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_decodes=sum(1 for q in query_lens if q == 1),
        num_prefills=sum(1 for q in query_lens if q > 1),
        causal=causal,
        block_size=block_size,
        plan=plan,
        **tensors,
    )
    # The layer-independent checks of the tensors, once here rather than on each step's first
    # layer (only buffers replaced by hand could fail them).
    from .step_checks import check_step_tensors  # step_checks imports this module
    check_step_tensors(_OP, md, device, "query_start_loc")
    if buffers is not None:
        buffers.now_holds(md)
    return md


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` names ``b`` (``cuda`` without an index names any ``cuda:N``)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


_INDEX_NAMES = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")


def plan_tensor_ptrs(tensors) -> tuple[int, ...]:
    """Data pointers of a step's index tensors (a dict or an ``AttentionMetadata``), in the
    order ``PlanBounds.tensor_ptrs`` records them."""
    if isinstance(tensors, dict):
        return tuple(tensors[n].data_ptr() for n in _INDEX_NAMES)
    md = tensors  # spelled out: this runs on each step's first layer
    return (md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(), md.block_table.data_ptr(),
            md.slot_mapping.data_ptr(), md.positions.data_ptr())


class MetadataBuffers:
    """Persistent device buffers for metadata, sized for the largest captured step.

    ``fill`` copies a step's host tensors into the leading part of each buffer and returns
    views of exactly the step's size; the addresses never change, so graphs captured on
    these views read each new step's values.

    The buffers hold one step: metadata built into them before the latest build would read
    the latest step's values through its views, and the layers refuse it (``check_current``).
    Every metadata object a layer checked against the buffers' step (the builder's, and copies
    of it: ``dataclasses.replace``, ``copy.copy``) is noted (``note_checked``), so the next fill
    drops each one's memoized checks and its next use is checked, and refused, again.
    A graph stand-in that replays Python under the metadata it captured
    (``RerunGraphBackend``), as a real graph reads each new step at the same addresses, keeps
    that metadata valid with ``keep_for_replay``.
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 device: torch.device | str):
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_tokens", max_num_tokens),
                            ("max_blocks_per_seq", max_blocks_per_seq)):
            check_positive_int("MetadataBuffers", name, value)
        self.device = device = as_device(device, "MetadataBuffers")
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self._plan: PlanBounds | None = None  # the plan of the step the buffers hold
        self._holder = None  # weak reference to that step's metadata
        self._checked_by: list[weakref.ref] = []  # metadata whose checks of that step are memoized
        self._replayed: list[PlanBounds] = []  # plans of captured steps a graph stand-in replays

    def now_holds(self, md: AttentionMetadata) -> None:
        """``md`` was just built into these buffers (``fill`` released the step before)."""
        self._plan, self._holder = md.plan, weakref.ref(md)

    def _release(self) -> None:
        """The step the buffers held is about to be overwritten: its metadata's memoized checks
        go (its next use is checked, and refused), and no metadata is current until the
        builder hands over the next (a build that fails after the fill leaves none)."""
        for ref in [self._holder, *self._checked_by]:
            old = ref() if ref is not None else None
            if old is not None and not self._kept(old.plan):
                old._checked.clear()  # in place: a copy.copy of the metadata shares the memo
        self._plan = self._holder = None
        self._checked_by = []

    def note_checked(self, md: AttentionMetadata) -> None:
        """A layer checked ``md`` (built into these buffers) and memoizes it: the next fill drops
        that memo. ``md`` may be a copy of the builder's metadata with a memo of its own."""
        self._checked_by.append(weakref.ref(md))

    def _kept(self, plan: PlanBounds | None) -> bool:
        return any(p is plan for p in self._replayed)

    def keep_for_replay(self, md: AttentionMetadata) -> None:
        """A graph stand-in replays Python under ``md`` (captured from these buffers) after later
        fills, reading each new step through its views as a real graph does: it stays valid."""
        if md.plan is not None and md.plan.buffers is self and not self._kept(md.plan):
            self._replayed.append(md.plan)

    def check_current(self, op: str, plan: PlanBounds) -> None:
        """Refuse a step (its ``plan``) these buffers no longer hold."""
        if plan is self._plan or self._kept(plan):
            return
        raise ValueError(
            f"{op}: the step's metadata was built into MetadataBuffers that a later "
            "build_attention_metadata(..., buffers=...) refilled with another step; its tensors now hold that "
            "step's values. Build each step's metadata right before the step runs")

    def fill(self, *, query_start_loc, seq_lens, block_table, slot_mapping, positions) -> dict:
        b, t, w = seq_lens.shape[0], slot_mapping.shape[0], block_table.shape[1]
        if b > self.max_num_seqs or t > self.max_num_tokens or w > self.max_blocks_per_seq:
            over = [f"{n} {what} > {name} {limit}" for n, limit, what, name in (
                (b, self.max_num_seqs, "sequences", "max_num_seqs"),
                (t, self.max_num_tokens, "tokens (padded)", "max_num_tokens"),
                (w, self.max_blocks_per_seq, "blocks in a sequence's table",
                 "the blocks of max_model_len")) if n > limit]
            raise ValueError(f"MetadataBuffers: the step does not fit the buffers it was sized for: "
                             f"{'; '.join(over)}")
        self._release()
        self.query_start_loc[: b + 1].copy_(query_start_loc, non_blocking=True)
        self.seq_lens[:b].copy_(seq_lens, non_blocking=True)
        self.block_table[:b, :w].copy_(block_table, non_blocking=True)
        self.slot_mapping[:t].copy_(slot_mapping, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        return dict(
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:t],
            positions=self.positions[:t],
        )
