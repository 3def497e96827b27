"""`StepIndex`: where one forward step writes in the page pool and what it may read (built by PagePool.prepare)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
