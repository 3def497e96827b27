"""oval page scores from int4 records in few torch ops: the static step's scorer where no kernel reads the records
(CUDA without Triton, as on a stock JetPack torch; a CPU without the C kernels).

Why not scoring.record_scores: it widens every listed page's record to fp32 through ~35 small ops (nibbles and
fifth bits split by shifts and masks, the rotation rebuilt, the basis rotated back page by page), then scores it
with r separate multiply-adds: ~85 launches per sparse layer, most of a torch-ops step. Here, per layer, 18 kernels,
none hidden inside an op (no index cast to int64 inside `index`, no copy inside `matmul`):

    query     q H and q, times the attention scale, in one matmul (q @ [c H | c I]) after its fp32 cast
    mean      gathered, cast, times q: the mean's term of every page, [G] per page
    basis     gathered as byte pairs (each nibble byte with the byte holding its two fifth bits), cast to int64,
              widened by one lookup in `level_pairs` (fifth bits included) and projected on q H: [r, G] per page
    scales    gathered; the mean's term joins the basis projections ([1 + r, G], the stored scales' order) and one
              multiply scales all of them
    coords    gathered as byte pairs, cast, widened by the same lookup, with a row of ones first: [1 + r, P]
    logits    coordinates^T @ projections: [P, G] per page, the mean's term included through the row of ones
    reduce    the log-sum-exp over the page's P tokens and G query heads as x0 - log_softmax(x)_0: one fused
              softmax kernel and a subtraction (torch.logsumexp runs about nine kernels on CUDA)

Every gather reads the pool's head-major records straight into [B, Hkv, Np, ...] (q's batch order), so each
matmul's operands are batched views cuBLAS takes as they are. Same scores as record_scores up to fp rounding
(tests/test_fake_cuda_step.py compares them); other record formats go to it.
"""

from __future__ import annotations

import torch

from oval_edge.kv.records.page_record import LayerRecords, Rotations, record_format, record_page_size
from oval_edge.record_layout import coord_fifth_ranks

# level_pairs' last index: which two bits of the fifth-bit byte a pair takes (0-3), or a 4-bit pair, or ones
FOUR_BIT, ONES = 4, 5


def level_pairs(device) -> torch.Tensor:
    """[256, 256, 6, 2] fp32: the two levels an int4 record's byte pair stands for (page_record.py's layout).

    [nibbles, bits, k] for k < 4: a 5-bit pair, the nibble byte's low and high nibble plus 16 times bits 2k and
    2k + 1 of the fifth-bit byte, less 16 (a 5-bit level is stored + 16); k = FOUR_BIT: a 4-bit pair, the nibbles
    less 8 (bits unread); k = ONES: 1 and 1 (the coordinates' row for the mean's term). 3 MiB, built once per
    device (Rotations.constant): one lookup widens a byte pair where separate nibble and bit lookups take three ops."""
    byte = torch.arange(256, device=device)
    nibbles = torch.stack((byte & 15, byte >> 4), dim=-1)  # [256, 2]
    pair_bits = torch.stack([torch.stack(((byte >> 2 * k) & 1, (byte >> 2 * k + 1) & 1), dim=-1) for k in range(4)],
                            dim=1)  # [256 bits, 4 k, 2]
    table = torch.empty(256, 256, ONES + 1, 2, device=device)
    table[:, :, :4] = (nibbles[:, None, None, :] + 16 * pair_bits[None] - 16).float()
    table[:, :, FOUR_BIT] = (nibbles[:, None, :] - 8).float()
    table[:, :, ONES] = 1.0
    return table


def basis_pairs(rank: int, dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte positions [2, r * D / 2] (nibble byte, fifth-bit byte) in a record's basis [r * (D / 2 + D / 8)] bytes and
    their level_pairs k [r * D / 2]: row i's elements 2j and 2j + 1 are the nibbles of its byte j, their fifth bits
    bits 2(j % 4) and 2(j % 4) + 1 of its byte D / 2 + j / 4."""
    row, pair = torch.arange(rank, device=device)[:, None], torch.arange(dim // 2, device=device)
    width = dim // 2 + dim // 8
    nib = row * width + pair
    bits = row * width + dim // 2 + pair // 4
    return torch.stack((nib, bits)).flatten(1), (pair % 4).expand(rank, -1).flatten()


def coord_pairs(rank: int, page: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte positions [2, (1 + r) * P / 2] in a record's coordinates and their k: a row of ones (bytes unread), then
    per rank i its tokens 2j, 2j + 1: the nibbles of byte i * P / 2 + j, for the first coord_fifth_ranks(r) ranks
    with fifth bits 2(j % 4), 2(j % 4) + 1 of byte r * P / 2 + i * P / 8 + j / 4; 4-bit ranks read no bits."""
    fifth = coord_fifth_ranks(rank)
    rank_of, pair = torch.arange(rank, device=device)[:, None], torch.arange(page // 2, device=device)
    nib = rank_of * (page // 2) + pair
    five = rank_of < fifth
    bits = torch.where(five, rank * page // 2 + rank_of * (page // 8) + pair // 4, nib)
    k = torch.where(five, pair % 4, FOUR_BIT)
    ones = torch.zeros(2, page // 2, dtype=torch.long, device=device)
    positions = torch.cat((ones, torch.stack((nib, bits)).flatten(1)), dim=1)
    return positions, torch.cat((torch.full((page // 2,), ONES, device=device), k.flatten()))


class PackedScorer:
    """Scores int4 records for the static step. head_dim D, scale: the attention scale, rotations: the owner's
    Rotations cache (H and the level table, shared by every step it builds). What scoring reads besides the records
    (the level table, the byte-pair positions of the records' shape) is built by `takes`, which the step's owner asks
    when it binds the scorer to a layer (oval_edge/sparse/step_ops_table.py), so before any step or capture; a
    device without such records never holds the table."""

    def __init__(self, head_dim: int, scale: float, device, rotations: Rotations) -> None:
        eye = torch.eye(head_dim, device=device)
        # [D, 2D]: q @ mix = [c q H | c q] (H symmetric), the rotated query for the basis and the plain one for the mean
        self.mix = torch.cat((rotations.get(head_dim, device), eye), dim=1) * scale
        self.head_dim, self.device, self.rotations = head_dim, torch.device(device), rotations
        self._tables: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # (Hkv, rank, page) -> tables

    def takes(self, records: LayerRecords) -> bool:
        """Whether this scorer reads `records` (int4 with scales); if it does, what scoring them reads is built now
        (once per shape)."""
        if record_format(records.basis) != "int4" or records.scales is None:
            return False
        self.tables(records)
        return True

    def tables(self, records: LayerRecords) -> tuple[torch.Tensor, ...]:
        """(level table, heads [Hkv, 1], basis byte positions and k, coordinate byte positions and k) on the device
        for records of this shape, built on the first ask (`takes`)."""
        hkv, rank = records.basis.shape[0], records.basis.shape[-2]
        page = record_page_size(records.basis, records.coords)
        key = (hkv, rank, page)
        if key not in self._tables:
            levels = self.rotations.constant("level_pairs", self.device, level_pairs)
            heads = torch.arange(hkv, device=self.device)[:, None]
            self._tables[key] = (levels, heads, *basis_pairs(rank, self.head_dim, self.device),
                                *coord_pairs(rank, page, self.device))
        return self._tables[key]

    def __call__(self, q: torch.Tensor, records: LayerRecords, page_table: torch.Tensor) -> torch.Tensor:
        """q [B, Hkv, G, D] over the pages page_table [B, Np] lists -> [B, Hkv, Np] fp32 (natural-log units)."""
        mean, basis, coords, scales = records
        b, hkv, g, d = q.shape
        n = page_table.shape[1]
        rank, page = basis.shape[-2], record_page_size(basis, coords)
        lookup, heads, basis_at, basis_k, coords_at, coords_k = self.tables(records)
        pages = page_table[:, None, :]  # [B, 1, Np] with heads [Hkv, 1]: records gathered as [B, Hkv, Np, ...]
        mixed = torch.matmul(q.float(), self.mix).transpose(-1, -2)  # [B, Hkv, 2D, G]
        rotated, plain = mixed[:, :, :d], mixed[:, :, d:]  # [B, Hkv, D, G] each
        centre = torch.matmul(mean[heads, pages].float(), plain)  # [B, Hkv, Np, G]
        codes = basis.view(hkv, -1, rank * basis.shape[-1])[heads[..., None, None], pages[..., None, None],
                                                            basis_at].long()  # [B, Hkv, Np, 2, r * D / 2]
        levels = lookup[codes[..., 0, :], codes[..., 1, :], basis_k]  # [B, Hkv, Np, r * D / 2, 2]
        del codes  # each phase's int64 codes and fp32 levels go before the next allocates: the step's peak is here
        proj = torch.matmul(levels.view(b, hkv, n * rank, d), rotated).view(b, hkv, n, rank, g)
        del levels
        proj = torch.cat((centre[:, :, :, None], proj), dim=3).mul_(scales[heads, pages][..., None])  # [.., 1 + r, G]
        codes = coords[heads[..., None, None], pages[..., None, None], coords_at].long()  # [B, Hkv, Np, 2, ..]
        values = lookup[codes[..., 0, :], codes[..., 1, :], coords_k].view(b, hkv, n, rank + 1, page)
        del codes
        logits = torch.matmul(values.transpose(-1, -2), proj).view(b, hkv, n, page * g)  # [B, Hkv, Np, P * G]
        return logits[..., 0] - logits.log_softmax(dim=-1)[..., 0]
