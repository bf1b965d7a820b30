"""Content hashes of full KV blocks, chained so a hash names a whole prefix.

A block's hash covers its parent's hash and its own token ids, so two blocks
share a hash only if the token runs from the start of the sequence match.
sha256 (not Python's per-process salted ``hash()``) keeps hashes stable across
processes and makes accidental collisions negligible; the pool still verifies
token ids on a hit.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_MARKER = b"\x00"
_CHILD_MARKER = b"\x01"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit chained hash of one block of token ids."""
    digest = hashlib.sha256()
    if parent_hash is None:
        digest.update(_ROOT_MARKER)
    else:
        digest.update(_CHILD_MARKER + parent_hash.to_bytes(8, "little"))
    # Fixed-width little-endian encoding: no two token runs share a byte string.
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(digest.digest()[:8], "little")


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, start_hashes: Sequence[int] = ()
) -> list[int]:
    """Hashes of every full block of ``token_ids``.

    ``start_hashes`` are already known hashes of the first blocks; they are kept
    as they are and hashing resumes after them, so a growing sequence is never
    rehashed from the start. The result includes them.
    """
    hashes = list(start_hashes)
    num_full_blocks = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for index in range(len(hashes), num_full_blocks):
        block_tokens = token_ids[index * block_size:(index + 1) * block_size]
        parent = hash_block_tokens(parent, block_tokens)
        hashes.append(parent)
    return hashes
