"""What the scheduler asks of a sequence's output constraint (a grammar), and the null one.

A guide follows the sequence's output tokens (it catches up on whatever was appended since it was
last asked, however it got there: sampled, accepted proposals, forced) and answers four questions:
which tokens each logits row may pick, how many proposals the grammar allows, which tokens the
grammar forces next (jump-forward), and whether it is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Guide(Protocol):
    def masks(self, output_token_ids: Sequence[int], proposals: Sequence[int]) -> list[bytes | None]:
        """One packed bitmask of allowed token ids (bit t of little-endian 32-bit words) per logits row:
        after the outputs, then after each proposal in turn; None where anything goes."""
        ...

    def num_valid(self, output_token_ids: Sequence[int], proposals: Sequence[int]) -> int:
        """How many leading proposals the constraint allows."""
        ...

    def forced(self, output_token_ids: Sequence[int]) -> list[int]:
        """Tokens that must come next whatever is sampled (appended without sampling)."""
        ...

    def complete(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the output is complete: the constraint allows nothing but the end."""
        ...

    def fork(self) -> Guide:
        """The same constraint for a sibling sequence, from no output."""
        ...


class Unguided:
    """No constraint (every request without one shares this object)."""

    def masks(self, output_token_ids: Sequence[int], proposals: Sequence[int]) -> list[bytes | None]:
        return [None] * (len(proposals) + 1)

    def num_valid(self, output_token_ids: Sequence[int], proposals: Sequence[int]) -> int:
        return len(proposals)

    def forced(self, output_token_ids: Sequence[int]) -> list[int]:
        return []

    def complete(self, output_token_ids: Sequence[int]) -> bool:
        return False

    def fork(self) -> Guide:
        return self


UNGUIDED = Unguided()
