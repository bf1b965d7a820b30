"""Chat prompts whose message text is always tokenized as text.

Rendering a conversation with the model's template and encoding the result would turn a user's
literal ``<|im_end|>`` into the control token, letting a message close its own turn. Instead the
template's own special tokens become control ids, and everything inside message contents
(located by rendering once more with unique markers in place of the contents) is encoded with
special-token parsing switched off. For content without special-token spellings the ids equal
``tokenizer.encode(rendered, add_special_tokens=False)``.
"""

from __future__ import annotations

import re

import tokenizers

from kvmosaic.model.tokenizer import Tokenizer

Span = tuple[int, int]
_MARKER = "\ue000{}\ue001"  # private-use code points: never produced by real text or templates
_MARKER_RE = re.compile("\ue000([0-9]+)\ue001")


class ChatPromptEncoder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._plain = tokenizers.Tokenizer.from_str(tokenizer.to_json())
        self._plain.encode_special_tokens = True  # special-token spellings become ordinary text
        self._special_ids = {tokenizer.id_to_token(i): i for i in tokenizer.all_special_ids}
        self._special_ids.pop(None, None)
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives))) if alternatives else None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        return self._tokenizer.apply_chat_template(messages, add_generation_prompt, tools)

    def encode(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> list[int]:
        """Token ids of the templated conversation; raises ValueError on a bad conversation."""
        rendered = self.render(messages, add_generation_prompt, tools)
        contents = [m["content"] for m in messages]
        spans = self._marked_spans(messages, rendered, add_generation_prompt, tools)
        if spans is None:
            spans = _find_spans(rendered, contents)
        if spans is None:
            if any(self._has_special(c) for c in contents):
                raise ValueError("cannot tell message text from template text for this chat template; "
                                 "remove special-token spellings from the messages")
            spans = []
        return self._encode(rendered, spans)

    def _marked_spans(self, messages: list[dict], rendered: str, add_generation_prompt: bool,
                      tools: list[dict] | None = None) -> list[Span] | None:
        """Spans of message contents in ``rendered``, if the template inserts contents verbatim."""
        marked = [dict(m, content=_MARKER.format(i)) for i, m in enumerate(messages)]
        try:
            template = self.render(marked, add_generation_prompt, tools)
        except ValueError:
            return None
        spans: list[Span] = []
        pieces: list[str] = []
        length = 0  # of "".join(pieces), kept as a running sum so the walk stays linear
        last = 0
        for match in _MARKER_RE.finditer(template):
            index = int(match.group(1))
            if index >= len(messages):  # marker-like text that came from elsewhere (a tool's description)
                return None
            content = messages[index]["content"]
            between = template[last : match.start()]
            start = length + len(between)
            pieces += (between, content)
            spans.append((start, start + len(content)))
            length = start + len(content)
            last = match.end()
        pieces.append(template[last:])
        return spans if "".join(pieces) == rendered else None

    def _encode(self, rendered: str, spans: list[Span]) -> list[int]:
        # Text runs and control ids in order; the runs are tokenized in one batch call, not one call each.
        runs: list[str | int] = []
        text_start = 0
        for seg_start, seg_end in _complement(spans, len(rendered)):
            if self._special_re is None:
                break
            for match in self._special_re.finditer(rendered, seg_start, seg_end):
                runs += (rendered[text_start : match.start()], self._special_ids[match.group()])
                text_start = match.end()
        runs.append(rendered[text_start:])
        texts = [run for run in runs if isinstance(run, str) and run]
        encoded = iter(self._plain.encode_batch(texts, add_special_tokens=False) if texts else [])
        ids: list[int] = []
        for run in runs:
            if isinstance(run, int):
                ids.append(run)
            elif run:
                ids += next(encoded).ids
        return ids

    def _has_special(self, text: str) -> bool:
        return self._special_re is not None and self._special_re.search(text) is not None


def _find_spans(rendered: str, contents: list[str]) -> list[Span] | None:
    """Fallback for templates that do not insert contents verbatim: locate each content in order."""
    spans: list[Span] = []
    pos = 0
    for content in contents:
        start = rendered.find(content, pos)
        if start < 0:
            return None
        spans.append((start, start + len(content)))
        pos = start + len(content)
    return spans


def _complement(spans: list[Span], length: int) -> list[Span]:
    """The parts of [0, length) outside the sorted, disjoint spans."""
    gaps: list[Span] = []
    pos = 0
    for start, end in sorted(spans):
        if start > pos:
            gaps.append((pos, start))
        pos = max(pos, end)
    if pos < length:
        gaps.append((pos, length))
    return gaps
