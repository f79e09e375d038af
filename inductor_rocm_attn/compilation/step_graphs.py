"""Whole-step graphs: the fixed shapes a step is planned in so that one captured graph of
the whole step (compiled pieces and the attention between them) serves every step of its
kind and size.

A graph replays its launches with the grids and host arguments of its capture; attention's
launches depend on the step only through the metadata's shapes and its two host hints
(``kernels/triton/paged_attention.py``). A step is therefore planned in the shapes of its
graph (``StepShape``), whatever its real mix:

- tokens padded to ``num_tokens`` (the captured size) with padding rows past
  ``query_start_loc[-1]`` (slot -1: no cache write, position 0);
- sequences padded to ``num_seqs`` with empty ones (query_len 0, seq_len 0): every
  attention kernel's programs of an empty sequence return before any load or store;
- the block table at its full width (``max_model_len`` / block size columns);
- ``max_seq_len = max_model_len`` (it only sets the KV split count: any value gives the
  same result) and ``max_query_len`` fixed per kind:

  * ``decode``: 1. Only the decode kernel is launched; for steps whose every sequence has
    one query token (``num_seqs == num_tokens``). The cheaper graph of a decode step.
  * ``mixed``: ``num_tokens``, the largest query a step of that size can hold, so every
    path is launched (decode; verify for sequences of 2..8 query tokens; prefix prefill for
    the longer ones) with a fixed grid, and each kernel skips the others' sequences. For
    any step of up to ``num_tokens`` tokens and ``num_seqs = min(num_tokens,
    max_num_seqs)`` sequences: prefill chunks, verify batches, decodes, in any mix.

The runner (``piecewise.PiecewiseRunner``) captures one graph per shape and picks, per step,
the decode graph when the step decodes only, else the mixed graph of its padded size.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from inductor_rocm_attn.metadata import AttentionMetadata, MetadataBuffers, build_attention_metadata

__all__ = ["DECODE", "MIXED", "StepShape", "step_shapes", "plan_step", "dummy_step"]

DECODE, MIXED = "decode", "mixed"


@dataclasses.dataclass(frozen=True)
class StepShape:
    """The fixed shapes of one whole-step graph (see the module docstring)."""

    kind: str  # DECODE or MIXED
    num_tokens: int
    num_seqs: int
    max_query_len: int

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.num_seqs


def step_shapes(capture_sizes: Sequence[int], max_num_seqs: int, *, decode: bool,
                mixed: bool) -> list[StepShape]:
    """The whole-step graphs to capture, largest first: a decode graph per size up to
    ``max_num_seqs`` (``decode``), a mixed graph per size >= 2 (``mixed``; a 1-token step
    always decodes, so size 1 takes a decode graph whenever either kind is on)."""
    shapes = []
    for size in sorted(set(capture_sizes), reverse=True):
        if mixed and size >= 2:
            shapes.append(StepShape(MIXED, size, min(size, max_num_seqs), size))
        if (decode or (mixed and size == 1)) and size <= max_num_seqs:
            shapes.append(StepShape(DECODE, size, size, 1))
    return shapes


def _fixed(md: AttentionMetadata, shape: StepShape, buffers: MetadataBuffers, max_model_len: int,
           num_actual_tokens: int) -> AttentionMetadata:
    return dataclasses.replace(
        md, block_table=buffers.block_table[: shape.num_seqs], max_query_len=shape.max_query_len,
        max_seq_len=max_model_len, num_actual_tokens=num_actual_tokens)


def plan_step(shape: StepShape, query_lens: Sequence[int], context_lens: Sequence[int],
              block_tables: Sequence[Sequence[int]], *, buffers: MetadataBuffers, block_size: int,
              max_model_len: int, device: torch.device,
              num_blocks: int | None = None) -> AttentionMetadata:
    """A step's metadata in ``shape`` (written into ``buffers``): its sequences, then empty
    ones up to ``shape.num_seqs``; its tokens, then padding rows up to ``shape.num_tokens``.
    ``num_actual_tokens`` stays the step's own count (the rows the caller reads back).
    ``num_blocks``: block ids at or past it are rejected (a graph replay runs no layer code
    that could)."""
    pad = shape.num_seqs - len(query_lens)
    md = build_attention_metadata(
        list(query_lens) + [0] * pad, list(context_lens) + [0] * pad,
        list(block_tables) + [[]] * pad, block_size, device, num_padded_tokens=shape.num_tokens,
        buffers=buffers, num_blocks=num_blocks)
    md = _fixed(md, shape, buffers, max_model_len, md.num_actual_tokens)
    buffers.now_holds(md)  # the metadata the caller runs: the next fill clears its memoized checks
    return md


def dummy_step(shape: StepShape, *, buffers: MetadataBuffers, max_model_len: int,
               block_size: int) -> AttentionMetadata:
    """Metadata in ``shape`` for warm-up and capture: one-token sequences and, for a mixed
    shape, one sequence holding the remaining tokens (a verify or prefill sequence), all
    without context, reading block 0, writing nothing (slots -1), at position 0 (inside any
    RoPE table, whatever the size)."""
    s, t = shape.num_seqs, shape.num_tokens
    qlens = [1] * (s - 1) + [t - (s - 1)]
    starts = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    host = dict(
        query_start_loc=starts,
        seq_lens=torch.tensor(qlens, dtype=torch.int32),
        block_table=torch.zeros(s, 1, dtype=torch.int32),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64),
        positions=torch.zeros(t, dtype=torch.int64),
    )
    views = buffers.fill(**host)
    buffers.block_table[:s].zero_()  # every column: a stale entry stays a readable block
    md = AttentionMetadata(num_actual_tokens=t, max_query_len=shape.max_query_len,
                           max_seq_len=max_model_len, num_decodes=sum(q == 1 for q in qlens),
                           num_prefills=sum(q > 1 for q in qlens), block_size=block_size, **views)
    return _fixed(md, shape, buffers, max_model_len, t)
