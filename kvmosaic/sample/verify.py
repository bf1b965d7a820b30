"""A step's proposals verified: the target's logits rows of each sequence -> the tokens it emits.

Each sequence brings k + 1 sampling rows, one per logits row (the row before each proposal, then the
bonus row), each seeing the proposals before it as outputs, so penalties and min_tokens bans apply
at every position exactly as plain decoding would apply them there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmosaic.outputs import SampledToken
from kvmosaic.sample.rejection import verify_dense, verify_greedy, verify_one_hot
from kvmosaic.sample.sampler import Argmax, SamplingRow, penalize_and_ban, sampled_tokens, target_probs, torch_argmax


@dataclass(slots=True)
class Verification:
    rows: list[SamplingRow]  # k + 1, one per logits row; all share the sequence's params and generator
    draft_ids: list[int]  # k
    draft_probs: torch.Tensor | None = None  # [k, vocab]; None: one-hot proposals

    def __post_init__(self) -> None:
        if len(self.rows) != len(self.draft_ids) + 1:
            raise ValueError(f"{len(self.draft_ids)} proposals need {len(self.draft_ids) + 1} rows, "
                             f"got {len(self.rows)}")


def verify(logits: torch.Tensor, verifications: list[Verification],
           argmax: Argmax = torch_argmax) -> list[list[SampledToken]]:
    """logits [sum of k + 1, vocab], the sequences' rows back to back -> each sequence's emitted
    tokens: accepted proposals, then the target's own token; logprobs from the raw logits. ``argmax``
    gives greedy sequences' target tokens (``logits.argmax(dim=-1)`` or a kernel with the same ids)."""
    rows = [row for v in verifications for row in v.rows]
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} logits rows for {len(rows)} sampling rows")
    logits = logits.float()
    processed = penalize_and_ban(logits, rows)
    emitted_rows: list[int] = []
    emitted_ids: list[int] = []
    counts: list[int] = []
    offset = 0
    for v in verifications:
        token_ids, num_emitted = _verify_one(processed[offset:offset + len(v.rows)], v, argmax)
        emitted_rows.extend(range(offset, offset + num_emitted))
        emitted_ids.extend(token_ids[:num_emitted])
        counts.append(num_emitted)
        offset += len(v.rows)
    tokens = sampled_tokens(logits[emitted_rows], torch.tensor(emitted_ids, dtype=torch.long),
                            [rows[i] for i in emitted_rows])
    out, start = [], 0
    for count in counts:
        out.append(tokens[start:start + count])
        start += count
    return out


def _verify_one(processed: torch.Tensor, v: Verification, argmax: Argmax) -> tuple[list[int], int]:
    draft_ids = torch.tensor([v.draft_ids], dtype=torch.long)
    first = v.rows[0]
    if first.params.greedy:
        token_ids, num_emitted = verify_greedy(argmax(processed)[None], draft_ids)
    else:
        probs = target_probs(processed, v.rows)[None]
        if v.draft_probs is None:
            token_ids, num_emitted = verify_one_hot(probs, draft_ids, first.generator)
        else:
            token_ids, num_emitted = verify_dense(probs, draft_ids, v.draft_probs[None].float(), first.generator)
    return token_ids[0].tolist(), int(num_emitted[0])
