"""`StepIndex`: where one forward step writes in the page pool and what it may read (built by PagePool.prepare)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch


@dataclass
class StepIndex:
    """Where one forward step writes and what it may read, built once per step (shared by every layer).

    For B sequences receiving n_b new tokens each (N = sum n_b):
        positions   [N]  absolute positions of the new tokens
        token_row   [N]  which batch row each new token belongs to
        write_base  [N]  flat slot of each new token in a layer's [pages*kv_heads*page_size] view, head 0;
                         head h lives at write_base + h * page_size
        page_table  [B, max_pages] physical pages (0-padded; `lengths` says what is valid)
        lengths     [B]  tokens in each sequence after this step
        sealed      [B]  pages with summaries (sealed before this step)
    """

    seq_ids: list
    new_tokens: list[int]
    positions: torch.Tensor
    token_row: torch.Tensor
    write_base: torch.Tensor
    page_table: torch.Tensor
    lengths: torch.Tensor
    sealed: torch.Tensor
    lengths_list: list[int]
    write_slots: torch.Tensor | None = None  # [N * kv_heads] write_base + h * page_size, built once per step
    # row -> [1, kv_heads, L] flat slots of the row's whole history (prefill over earlier pages), built by the first
    # layer that reads them and shared by the others
    history_slots: dict = field(default_factory=dict)
    # Sliding-window layers (ring.py), set by attach_rings: each row's first ring page [B], and the step's ring
    # writes (token indices [M] into the N new tokens, their rows [M * kv_heads] in a ring layer's view)
    ring_base: torch.Tensor | None = None
    ring_writes: tuple[torch.Tensor | None, torch.Tensor] | None = None

    def attach_rings(self, rings, device) -> None:
        """Where this step's tokens go in the sliding layers' rings (PagePool.prepare)."""
        tokens, slots = rings.write_plan(self.seq_ids, self.new_tokens, self.lengths_list)
        g = rings.geometry
        heads = torch.arange(g.kv_heads) * g.page_size
        rows = (torch.tensor(slots, dtype=torch.long)[:, None] + heads[None, :]).reshape(-1)
        self.ring_base = torch.tensor([rings.base(sid) for sid in self.seq_ids], dtype=torch.long, device=device)
        # tokens None: every new token is kept (decode steps, short chunks), so the writer needs no gather
        kept = None if len(tokens) == len(self.positions) else torch.tensor(tokens, dtype=torch.long, device=device)
        self.ring_writes = (kept, rows.to(device))



def build_step_index(seq_ids: Sequence[Hashable], new_tokens: Sequence[int], tables: dict, lengths_of: dict,
                     sealed_of: dict, page_size: int, kv_heads: int, device, resident: int | None = None) -> StepIndex:
    """PagePool.prepare: where `new_tokens[b]` tokens of each sequence go, from the pool's page tables, lengths and
    sealed page counts (dicts keyed by sequence). Pages must already be reserved; with a page store, pages written
    must have ids below `resident` (PagePool.make_resident)."""
    P, H = page_size, kv_heads

    def pages_needed(tokens: int) -> int:
        return -(-tokens // P)

    positions, rows, bases, lengths, sealed = [], [], [], [], []
    for row, (sid, n) in enumerate(zip(seq_ids, new_tokens)):
        table = tables[sid]
        start = lengths_of[sid]
        end = start + n
        if pages_needed(end) > len(table):
            raise ValueError(f"sequence {sid!r} needs {pages_needed(end)} pages for {end} tokens but owns "
                             f"{len(table)}; grow() it first")
        pos = range(start, end)
        if resident is not None and n and any(table[j] >= resident for j in range(start // P, pages_needed(end))):
            raise ValueError(f"sequence {sid!r} writes into a page that is in the page store; call "
                             "PagePool.make_resident first")
        positions.extend(pos)
        rows.extend([row] * n)
        bases.extend(table[p // P] * H * P + p % P for p in pos)
        lengths.append(end)
        sealed.append(sealed_of[sid])
    width = max(pages_needed(n) for n in lengths) if lengths else 0
    page_table = torch.zeros((len(seq_ids), max(width, 1)), dtype=torch.long)
    for row, sid in enumerate(seq_ids):
        used = tables[sid][: pages_needed(lengths[row])]
        page_table[row, : len(used)] = torch.tensor(used, dtype=torch.long)

    def on_device(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return StepIndex(seq_ids=list(seq_ids), new_tokens=list(new_tokens), positions=on_device(positions),
                     token_row=on_device(rows), write_base=on_device(bases), page_table=page_table.to(device),
                     lengths=on_device(lengths), sealed=on_device(sealed), lengths_list=lengths)
