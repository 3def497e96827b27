"""oval page scores from int4 records in few torch ops: the static step's scorer where no kernel reads the records
(CUDA without Triton, as on a stock JetPack torch; a CPU without the C kernels).

Why not scoring.record_scores: it widens every listed page's record to fp32 through ~35 small ops (nibbles and
fifth bits split by shifts and masks, the rotation rebuilt, the basis rotated back page by page), then scores it
with r separate multiply-adds: ~85 launches per sparse layer, most of a torch-ops step. Here, per layer, 28:

    gather    the listed pages' mean, basis, coords, scales (4 index_selects; [Hkv, B * Np, ...], head-major as the
              pool stores them, so no copy reorders them)
    widen     bytes -> levels through two lookup tables built once (a byte's two nibbles; its eight bits as 16 * bit):
              a 5-bit level is nibble + 16 * bit - 16, a 4-bit coordinate nibble - 8 (page_record.py's layout)
    project   the query is rotated once (q H, the frame the basis rows are stored in) and scaled to base-2 logits
              in the same matmul (q @ [c H | c I], c = scale * log2 e): the basis levels meet H q, the mean meets q,
              and the per-rank scales multiply the [r, G] projections, not the [r, D] rows
    logits    coordinates^T @ projections + mean term: [P, G] per page in one batched matmul
    reduce    the log-sum-exp over the page's P tokens and G query heads (base 2, returned in natural-log units)

Same scores as record_scores (tests/test_fake_cuda_step.py compares them); other record formats go to it.
"""

from __future__ import annotations

import math

import torch

from oval_edge.kv.page_record import LayerRecords, Rotations, record_format, record_page_size
from oval_edge.record_layout import coord_fifth_ranks

LOG2_E, LN_2 = 1.0 / math.log(2.0), math.log(2.0)


def _byte_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """nibbles [256, 2]: a byte's low and high nibble; bits [256, 8]: its bits, bit i in column i (fp32)."""
    byte = torch.arange(256, device=device)
    nibbles = torch.stack((byte & 15, byte >> 4), dim=-1).float()
    bits = ((byte[:, None] >> torch.arange(8, device=device)) & 1).float()
    return nibbles, bits


class PackedScorer:
    """Scores one layer's int4 records for the static step; its tables are built at construction (before a CUDA
    graph captures the step). head_dim D, scale: the attention scale, rotations: the owner's Rotations cache."""

    def __init__(self, head_dim: int, scale: float, device, rotations: Rotations) -> None:
        nibbles, bits = _byte_tables(device)
        self.basis_nibbles = nibbles - 16  # a 5-bit level = stored nibble + 16 * bit - 16
        self.coord_nibbles = nibbles - 8  # a 4-bit coordinate = nibble - 8; a 5-bit one adds 16 * bit - 8
        self.basis_bits, self.coord_bits = bits * 16, bits * 16 - 8
        c = scale * LOG2_E
        eye = torch.eye(head_dim, device=device)
        # [D, 2D]: q @ mix = [c q H | c q] (H symmetric), the rotated query for the basis and the plain one for the mean
        self.mix = torch.cat((rotations.get(head_dim, device) * c, eye * c), dim=1)
        self.head_dim = head_dim

    def takes(self, records: LayerRecords) -> bool:
        return record_format(records.basis) == "int4" and records.scales is not None

    def __call__(self, q: torch.Tensor, records: LayerRecords, page_table: torch.Tensor) -> torch.Tensor:
        """q [B, Hkv, G, D] over the pages page_table [B, Np] lists -> [B, Hkv, Np] fp32 (natural-log units)."""
        mean, basis, coords, scales = records
        b, hkv, g, d = q.shape
        n = page_table.shape[1]
        rank, page = basis.shape[-2], record_page_size(basis, coords)
        fifth = coord_fifth_ranks(rank)
        flat = page_table.reshape(-1)
        mean, basis, coords, scales = (t.index_select(1, flat) for t in (mean, basis, coords, scales))
        mixed = torch.matmul(q.float(), self.mix).permute(1, 0, 3, 2)  # [Hkv, B, 2D, G]
        rotated, plain = mixed[:, :, :d], mixed[:, :, d:]  # [Hkv, B, D, G] each
        # basis levels [Hkv, B * Np, r, D]: nibbles then fifth bits of each row (page_record._pack_int5)
        codes = basis.int()
        levels = self.basis_nibbles[codes[..., : d // 2]].view(*codes.shape[:-1], d)
        levels += self.basis_bits[codes[..., d // 2:]].view(*codes.shape[:-1], d)
        scales = scales.view(hkv, b, n, rank + 1, 1)
        proj = torch.matmul(levels.view(hkv, b, n * rank, d), rotated).view(hkv, b, n, rank, g) * scales[:, :, :, 1:]
        centre = torch.matmul(mean.float().view(hkv, b, n, d), plain)[:, :, :, None] * scales[:, :, :, :1]
        # coordinate levels [Hkv, B * Np, r, P]: rank-major nibbles, then the first `fifth` rows' fifth bits
        codes = coords.int()
        split = rank * page // 2
        values = self.coord_nibbles[codes[..., :split]].view(hkv, b, n, rank, page)
        values[..., :fifth, :].add_(self.coord_bits[codes[..., split:]].view(hkv, b, n, fifth, page))  # no copy back
        logits = torch.matmul(values.transpose(-1, -2), proj).add_(centre)  # [Hkv, B, Np, P, G] base-2 logits
        logits = logits.view(hkv, b, n, page * g)
        peak = logits.amax(dim=-1, keepdim=True)
        total = logits.sub_(peak).exp2_().sum(dim=-1).log_()  # natural log of the base-2 sum
        return torch.add(total, peak.squeeze(-1), alpha=LN_2).permute(1, 0, 2)
