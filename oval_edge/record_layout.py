"""Byte layout of the int4 oval page record (oval_edge/kv/records/page_record.py has the format): how many coordinate rows carry a
fifth bit and how many bytes a basis row and a record's coordinates take. No torch: the planner (geometry.py) sizes
pools with it, and the kernels' wrappers check tensors against it. score_kernels.c mirrors it (FIFTH_RANKS,
INT5_ROW_BYTES, INT4_COORD_BYTES)."""

from __future__ import annotations


def coord_fifth_ranks(rank: int) -> int:
    """How many of an int4 record's coordinate rows carry a fifth bit: the first three quarters of the ranks (the
    basis is ordered by singular value, so these hold most of a page's key energy). Why three quarters: at r = 8
    (D = 64, P = 32) that spends what fp16 scales free and keeps the record within a third of the bf16 one (554
    of 1,664 bytes); measured, the fifth bits on these ranks take the record's KL over float's from +2.6-2.8% to
    +0.7-1.9% on Alice's second 4k window (docs/oval-index.md)."""
    return 3 * rank // 4


def int5_row_bytes(dim: int) -> int:
    """Bytes of one int4 record's basis row of `dim` 5-bit values: dim / 2 of low nibbles, dim / 8 of fifth bits."""
    return dim // 2 + dim // 8


def int4_coord_bytes(rank: int, page_size: int) -> int:
    """Bytes of one int4 record's coordinates: every rank's low nibbles, then the fifth bits of the first
    coord_fifth_ranks(rank) ranks."""
    return rank * page_size // 2 + coord_fifth_ranks(rank) * page_size // 8
