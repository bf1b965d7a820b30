"""The inputs of multi-step decoding's later passes: one row per sequence, each at its next
position, built once and then moved one slot on per pass (vLLM's ``advance_step``) instead of
being rebuilt from the scheduled requests; the tables already hold every slot the passes use."""

from __future__ import annotations

import numpy as np
import torch

from kvmosaic.attention.metadata import AttentionMetadata
from kvmosaic.outputs import ScheduledRequest


class DecodeRows:
    def __init__(self, scheduled: list[ScheduledRequest], block_size: int) -> None:
        """Rows for sequences decoding one token each (in this order), at ``start_pos``."""
        self.block_size = block_size
        self.tables = np.zeros((len(scheduled), max(len(s.block_table) for s in scheduled)), dtype=np.int64)
        for row, s in enumerate(scheduled):  # padded with block 0, never read past a row's length
            self.tables[row, : len(s.block_table)] = s.block_table
        self.positions = np.array([s.start_pos for s in scheduled], dtype=np.int64)
        self.logits_indices = torch.arange(len(scheduled))
        self._build([s.token_ids[0] for s in scheduled])

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    def advance(self, token_ids: list[int]) -> None:
        """The next pass: each row one position on, with the token it just sampled as input."""
        self.positions = self.positions + 1
        self._build(token_ids)

    def _build(self, token_ids: list[int]) -> None:
        bs, positions = self.block_size, self.positions
        blocks = self.tables[np.arange(len(positions)), positions // bs]
        self.input_ids = torch.from_numpy(np.asarray(token_ids, dtype=np.int64))
        self.position_ids = torch.from_numpy(positions)
        self.meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(blocks * bs + positions % bs), num_decode_tokens=len(positions),
            decode_block_tables=torch.from_numpy(self.tables), decode_mask=None,
            decode_context_lens=torch.from_numpy(positions + 1))
