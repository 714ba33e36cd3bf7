"""What a scheduler schedules: sequences x heads, cut into chunks, plus the work tile it hands out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Problem:
    """A batch of sequences, each processed per head in chunks of `chunk_size` tokens.

    Linear attention: a sequence is one batch row (or `cu_seqlens` entry), a chunk is C tokens of the recurrence,
    `num_blocks` the number of V tiles per (sequence, head). Split-KV attention: a sequence is one batch row's KV
    cache, heads are KV heads, a chunk is one KV block, `num_blocks` the number of query tiles.
    `seq_starts[n]`: sequence n's first token in the flattened token axis (n * T fixed-length, `cu_seqlens[n]` varlen).
    """

    seq_lens: tuple[int, ...]
    seq_starts: tuple[int, ...]
    num_heads: int
    chunk_size: int = 64
    num_blocks: int = 1

    def __post_init__(self):
        if len(self.seq_lens) != len(self.seq_starts):
            raise ValueError("seq_lens and seq_starts must have the same length")
        if any(n < 0 for n in self.seq_lens):
            raise ValueError(f"seq_lens must be >= 0, got {self.seq_lens}")
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    @classmethod
    def fixed(cls, batch: int, seq_len: int, num_heads: int, chunk_size: int = 64, num_blocks: int = 1) -> "Problem":
        """`batch` sequences of `seq_len` tokens each, stored as [B, T, ...]."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return cls(
            seq_lens=(seq_len,) * batch,
            seq_starts=tuple(b * seq_len for b in range(batch)),
            num_heads=num_heads,
            chunk_size=chunk_size,
            num_blocks=num_blocks,
        )

    @classmethod
    def varlen(cls, cu_seqlens: Sequence[int], num_heads: int, chunk_size: int = 64, num_blocks: int = 1) -> "Problem":
        """Packed sequences, `cu_seqlens` = [0, end_0, end_1, ...] (a list, or a tensor: read once to the host)."""
        if hasattr(cu_seqlens, "tolist"):
            cu_seqlens = cu_seqlens.tolist()
        cu = [int(x) for x in cu_seqlens]
        if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with >= 2 entries, got {cu[:8]}...")
        return cls(
            seq_lens=tuple(b - a for a, b in zip(cu, cu[1:])),
            seq_starts=tuple(cu[:-1]),
            num_heads=num_heads,
            chunk_size=chunk_size,
            num_blocks=num_blocks,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def num_chunks(self, n: int) -> int:
        return ceil_div(self.seq_lens[n], self.chunk_size)

    @property
    def chunks(self) -> tuple[int, ...]:
        return tuple(self.num_chunks(n) for n in range(self.num_seqs))

    @property
    def is_uniform(self) -> bool:
        return len(set(self.seq_lens)) <= 1


# Column order of a work tile in the int32 tile table that the device reads.
TILE_FIELDS = (
    "seq",           # sequence (batch row or cu_seqlens entry)
    "head",          # head (KV head for attention)
    "block",         # V tile (linear attention) or query tile (attention)
    "segment",       # segment index within the (sequence, head): 0 .. num_segments-1
    "num_segments",  # segments of this sequence
    "seg_slot",      # global segment index: seg_offsets[seq] + segment (where summaries / partials go)
    "chunk_start",   # first chunk of the segment, counted from the sequence start
    "chunk_end",     # one past the last chunk
    "tok_start",     # first token of the segment in the flattened token axis
    "tok_end",       # one past its last token (flattened)
)
NUM_TILE_FIELDS = len(TILE_FIELDS)


@dataclass(frozen=True)
class WorkTile:
    """One unit of work: a contiguous chunk range of one (sequence, head, block)."""

    seq: int
    head: int
    block: int
    segment: int
    num_segments: int
    seg_slot: int
    chunk_start: int
    chunk_end: int
    tok_start: int
    tok_end: int

    @property
    def is_first_segment(self) -> bool:
        return self.segment == 0

    @property
    def is_last_segment(self) -> bool:
        return self.segment == self.num_segments - 1

    @property
    def num_tokens(self) -> int:
        return self.tok_end - self.tok_start

    def as_row(self) -> tuple[int, ...]:
        return tuple(getattr(self, f) for f in TILE_FIELDS)


@dataclass
class Segmentation:
    """Chunk bounds per sequence: `bounds[n] = [0, c1, ..., num_chunks(n)]` (one segment: [0, num_chunks])."""

    bounds: list[list[int]]
    seg_offsets: list[int] = field(init=False)

    def __post_init__(self):
        self.seg_offsets = [0]
        for b in self.bounds:
            self.seg_offsets.append(self.seg_offsets[-1] + len(b) - 1)

    @property
    def total_segments(self) -> int:
        return self.seg_offsets[-1]

    def segments_of(self, n: int) -> int:
        return len(self.bounds[n]) - 1


def split_even(num_chunks: int, num_segments: int) -> list[int]:
    """Bounds of `num_segments` contiguous near-equal groups of `num_chunks` chunks, none empty; the first
    `num_chunks % n` get one chunk more. 0 chunks keep one empty segment (a tile that writes the final state)."""
    if num_chunks <= 0:
        return [0, 0]
    n = max(1, min(num_segments, num_chunks))
    base, extra = divmod(num_chunks, n)
    bounds = [0]
    for s in range(n):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds
