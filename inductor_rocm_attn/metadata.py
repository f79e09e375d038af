"""Per-step attention metadata and its builder (the "plan" half of plan/run).

The builder turns per-sequence ``(query_len, context_len)`` and block tables into the index
tensors the kernels read. It can write into persistent buffers (``MetadataBuffers``) so a
captured HIP/CUDA graph sees the new step's values at fixed addresses.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = ["AttentionMetadata", "MetadataBuffers", "build_attention_metadata"]


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
    they are the captured upper bounds.
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

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def _host_plan(query_lens: Sequence[int], context_lens: Sequence[int],
               block_tables: Sequence[Sequence[int]], block_size: int,
               padding: Sequence[bool] | None = None):
    if not (len(query_lens) == len(context_lens) == len(block_tables)):
        raise ValueError(
            "build_attention_metadata: query_lens, context_lens and block_tables must have one "
            f"entry per sequence, got {len(query_lens)}, {len(context_lens)}, {len(block_tables)}"
        )
    if padding is not None and len(padding) != len(query_lens):
        raise ValueError(f"build_attention_metadata: padding has {len(padding)} entries for {len(query_lens)} sequences")
    qsl = [0]
    seq_lens, slots, positions = [], [], []
    for s, (ql, cl, bt) in enumerate(zip(query_lens, context_lens, block_tables)):
        if ql < 0 or cl < 0:
            raise ValueError(f"build_attention_metadata: sequence {s} has query_len {ql}, context_len {cl}")
        sl = ql + cl
        qsl.append(qsl[-1] + ql)
        seq_lens.append(sl)
        if padding is not None and padding[s]:
            if cl:
                raise ValueError(f"build_attention_metadata: padding sequence {s} has context_len {cl} (must be 0)")
            slots += [-1] * ql
            positions += [0] * ql
            continue
        need = -(-sl // block_size)
        if need > len(bt):
            raise ValueError(
                f"build_attention_metadata: sequence {s} has {sl} tokens and needs {need} blocks of "
                f"{block_size}, but its block table has {len(bt)}"
            )
        for p in range(cl, sl):
            positions.append(p)
            slots.append(bt[p // block_size] * block_size + p % block_size)
    return qsl, seq_lens, slots, positions


def build_attention_metadata(
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    *,
    num_padded_tokens: int | None = None,
    buffers: "MetadataBuffers | None" = None,
    padding: Sequence[bool] | None = None,
    causal: bool | None = None,
) -> AttentionMetadata:
    """Metadata for a batch where sequence s has ``context_lens[s]`` cached tokens and
    ``query_lens[s]`` new ones, stored in the blocks ``block_tables[s]``.

    ``num_padded_tokens`` pads the token dimension (slot -1, position 0) for a captured
    batch size. With ``buffers``, values are copied into them and views returned.
    ``padding[s]`` marks sequence s as padding rows inside the batch (e.g. the left padding
    of a ``[batch, tokens]`` layout): its tokens write nothing (slot -1, position 0), it has
    no context, and its block table names one readable block (a one-token padding sequence
    is a decode and reads its key there); its attention output rows are unspecified.
    ``causal`` sets the step's causality for decoder layers (None: each layer's own).
    """
    qsl, seq_lens, slots, positions = _host_plan(query_lens, context_lens, block_tables, block_size, padding)
    n = len(slots)
    total = n if num_padded_tokens is None else num_padded_tokens
    if total < n:
        raise ValueError(f"build_attention_metadata: num_padded_tokens {total} < {n} real tokens")
    slots += [-1] * (total - n)
    positions += [0] * (total - n)
    width = max([len(bt) for bt in block_tables] + [1])
    table = [list(bt) + [0] * (width - len(bt)) for bt in block_tables]
    host = dict(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32).reshape(len(block_tables), width),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
    )
    if buffers is not None:
        tensors = buffers.fill(**host)
    else:
        tensors = {k: v.to(device, non_blocking=True) for k, v in host.items()}
    return AttentionMetadata(
        num_actual_tokens=n,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        num_decodes=sum(1 for q in query_lens if q == 1),
        num_prefills=sum(1 for q in query_lens if q > 1),
        causal=causal,
        **tensors,
    )


class MetadataBuffers:
    """Persistent device buffers for metadata, sized for the largest captured step.

    ``fill`` copies a step's host tensors into the leading part of each buffer and returns
    views of exactly the step's size; the addresses never change, so graphs captured on
    these views read each new step's values.
    """

    def __init__(self, max_num_seqs: int, max_num_tokens: int, max_blocks_per_seq: int,
                 device: torch.device | str):
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.query_start_loc = torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)

    def fill(self, *, query_start_loc, seq_lens, block_table, slot_mapping, positions) -> dict:
        b, t, w = seq_lens.shape[0], slot_mapping.shape[0], block_table.shape[1]
        if b > self.max_num_seqs or t > self.max_num_tokens or w > self.max_blocks_per_seq:
            raise ValueError(
                f"MetadataBuffers: step of {b} sequences, {t} tokens, {w} blocks/seq exceeds the "
                f"buffers ({self.max_num_seqs}, {self.max_num_tokens}, {self.max_blocks_per_seq})"
            )
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
