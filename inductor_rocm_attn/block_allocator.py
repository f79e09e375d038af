"""A small paged block allocator: hands out cache blocks per sequence and frees them."""

from __future__ import annotations

import random

from .capabilities import check_block_size
from .validation import is_int as _is_int


class BlockAllocator:
    """Free-list allocator over ``num_blocks`` cache blocks of ``block_size`` tokens.

    ``shuffle_seed`` randomises the free list so tests exercise scattered block placement.
    """

    def __init__(self, num_blocks: int, block_size: int, *, shuffle_seed: int | None = None):
        if not _is_int(num_blocks) or num_blocks <= 0:
            raise ValueError(f"BlockAllocator: num_blocks must be a positive int, got {num_blocks!r}")
        check_block_size(block_size, "BlockAllocator")  # the caches' block size: no other can be planned
        if shuffle_seed is not None and not _is_int(shuffle_seed):  # random.Random takes any hashable
            raise TypeError(f"BlockAllocator: shuffle_seed must be an int or None, got {shuffle_seed!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self._free)
        self._free.reverse()  # pop() from the end hands out the list's first entries first
        self._tables: dict[object, list[int]] = {}
        self._lengths: dict[object, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        if not _is_int(num_tokens) or num_tokens < 0:  # a negative count needed 0 blocks
            raise ValueError(f"BlockAllocator.blocks_needed: num_tokens must be an int >= 0, got {num_tokens!r}")
        return -(-num_tokens // self.block_size)

    def allocate(self, seq_id, num_new_tokens: int) -> list[int]:
        """Grow ``seq_id`` by ``num_new_tokens`` tokens; returns its whole block table (a copy:
        a caller that edits it changes nothing here)."""
        if not _is_int(num_new_tokens) or num_new_tokens < 0:
            raise ValueError(f"BlockAllocator.allocate: num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        table = self._table(seq_id, "allocate", [])
        length = self._lengths.get(seq_id, 0) + num_new_tokens
        need = self.blocks_needed(length) - len(table)
        if need > len(self._free):  # refused: the sequence (if any) keeps its blocks and length
            raise MemoryError(
                f"BlockAllocator: sequence {seq_id!r} needs {need} more blocks, {len(self._free)} free "
                f"of {self.num_blocks}"
            )
        for _ in range(need):
            table.append(self._free.pop())
        self._tables[seq_id] = table
        self._lengths[seq_id] = length
        return list(table)

    def free(self, seq_id) -> None:
        table = self._table(seq_id, "free")
        if table is None:
            raise KeyError(f"BlockAllocator.free: unknown sequence {seq_id!r} (never allocated, or freed already)")
        del self._tables[seq_id]
        self._lengths.pop(seq_id, None)
        self._free.extend(reversed(table))

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Shrink ``seq_id`` to its first ``num_tokens`` tokens (at most its length), handing
        back the blocks it no longer needs; 0 frees it. Undoes ``allocate`` calls exactly."""
        length = self._lengths.get(seq_id) if self._table(seq_id, "truncate") is not None else None
        if length is None:
            raise KeyError(f"BlockAllocator.truncate: unknown sequence {seq_id!r}")
        if not _is_int(num_tokens) or not 0 <= num_tokens <= length:
            raise ValueError(f"BlockAllocator.truncate: num_tokens must be an int in [0, {length}] (the length "
                             f"of {seq_id!r}), got {num_tokens!r}")
        if num_tokens == 0:
            self.free(seq_id)
            return
        table = self._tables[seq_id]
        keep = self.blocks_needed(num_tokens)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lengths[seq_id] = num_tokens

    def block_table(self, seq_id) -> list[int]:
        """``seq_id``'s block table (a copy, as ``allocate`` returns)."""
        table = self._table(seq_id, "block_table")
        if table is None:
            raise KeyError(f"BlockAllocator.block_table: unknown sequence {seq_id!r} (allocate it first)")
        return list(table)

    def num_tokens(self, seq_id) -> int:
        """``seq_id``'s tokens (0 for a sequence not allocated yet, or freed)."""
        self._table(seq_id, "num_tokens")
        return self._lengths.get(seq_id, 0)

    def _table(self, seq_id, method: str, default=None):
        """``seq_id``'s table (``default`` if it has none); a sequence id that cannot be a key
        (a list) names the method, not Python's "unhashable type"."""
        try:
            return self._tables.get(seq_id, default)
        except TypeError:
            raise TypeError(f"BlockAllocator.{method}: seq_id must be hashable (e.g. an int or a str), got "
                            f"{type(seq_id).__name__} {seq_id!r:.40}") from None
