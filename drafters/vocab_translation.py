"""A draft model with another tokenizer than the target's: its drafts translated to the target's vocabulary.

Universal assisted generation (Hugging Face transformers' ``assistant_tokenizer``; Timor et al. 2025): the draft model
reads the request's text as its own tokenizer writes it and drafts in its own vocabulary. A greedy request's drafts
go back through their text (string-level exact match): the target's tokenizer's encoding of it is what the target
verifies, with no q. A sampled request's drafts are drawn among the tokens both vocabularies hold (token-level
intersection, :func:`_twins`: spelled the same and decoded to the same text), each mapped to its twin, q carried over
to the target's ids, so rejection sampling keeps the target's distribution as for any draft model (a draft's text
alone, without q, would leave only coupling: accepted with probability p(x) instead of min(1, p(x) / q(x))). Without
shared tokens sampled requests draft through text too. Verification stays exact either way.

Per request, both sides grow with the history, re-encoding only its tail:

* target -> text: the target's tokens decoded a window at a time (:meth:`_Target.update`), text that ends in an
  incomplete UTF-8 sequence held back until the token that completes it; each update leaves a mark (tokens, text
  length), and a history that forgets tokens (a prefetch's assumed drafts, rejected) rolls the text back to the
  last mark before them.
* text -> draft tokens (:meth:`_Draft.update`): the draft tokens wholly inside the text that did not change are
  kept but the last ``_BACK`` (new text may merge with them), and the rest is encoded again from a restart token;
  the restart holds only where encoding from ``_CONTEXT`` tokens before it writes those tokens again with the same
  boundary (a sentencepiece tokenizer's dummy prefix mid-word would not), else it moves back a token, down to
  encoding the whole text.
* draft tokens -> target tokens (:meth:`VocabTranslator.to_target`): the drafts' text (decoded after a few tokens
  of context, so a leading space stays) encoded by the target's tokenizer after the last ``_WINDOW`` characters of
  the committed text; the tokens from the first boundary at the committed text's end on, or the drafts' text
  encoded alone where the target's tokenizer would merge it into the last committed token.

Penalties, logit biases and grammars name the target's token ids, so a translated draft model drafts without them
(the target's verification applies them). Both tokenizers must be fast ones (a Rust backend with offsets).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specray.detokenizer import decoder_for
from specray.drafters.ngram import common_prefix

_BACK = 2  # draft tokens before the changed text encoded again (new text may merge into them)
_CONTEXT = 2  # tokens before a restart that must come out of its encoding as they were
_WINDOW = 32  # characters of committed text the target's tokenizer reads before the drafts' text
_DECODE_CONTEXT = 4  # tokens decoded before new ones (their text dropped): leading spaces come out right
_MARKS = 256  # the target's updates a history can roll back to (a prefetch's rejected assumptions: the last few)


def translatable(tokenizer) -> str | None:
    """None when drafts can be translated to or from ``tokenizer``, else why not."""
    if getattr(tokenizer, "_tokenizer", None) is None or not hasattr(tokenizer._tokenizer, "encode"):
        return f"{type(tokenizer).__name__} is not a fast tokenizer (no Rust backend to encode with offsets)"
    return None


def same_vocabulary(target, draft) -> bool:
    """Whether the two tokenizers give every token the same id (a draft model then needs no translation)."""
    return target.get_vocab() == draft.get_vocab()


def _twins(target, draft) -> dict[int, int]:
    """The tokens both vocabularies hold (Timor et al.'s token-level intersection): draft id -> target id, for each
    token spelled the same in both whose text the two tokenizers decode alike."""
    target_vocab = target.get_vocab()
    pairs = [(i, target_vocab[token]) for token, i in draft.get_vocab().items() if token in target_vocab]
    texts = (side._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
             for side, ids in ((draft, [d for d, _ in pairs]), (target, [t for _, t in pairs])))
    return {d: t for (d, t), a, b in zip(pairs, *texts) if a == b}


class _Side:
    """One tokenizer's encode (ids and character offsets, no special tokens unless asked) and decode."""

    def __init__(self, tokenizer):
        self.backend = tokenizer._tokenizer
        self.decode: Callable[[list[int]], str] = decoder_for(tokenizer, skip_special_tokens=False)
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        # a BOS its encodings start with (a marker, not text; one whose token also opens a chat turn is text)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos = bos if bos is not None and self.backend.encode("a", add_special_tokens=True).ids[:1] == [bos] \
            else None

    def encode(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return list(enc.ids), list(enc.offsets)

    def text_after(self, context: list[int], ids: list[int]) -> str:
        """The text ``ids`` add after ``context`` (decoded together, the context's text dropped)."""
        base = self.decode(context)
        full = self.decode(context + ids)
        return full[len(base):] if full.startswith(base) else self.decode(ids)


@dataclass
class _Target:
    """The target's tokens of one request whose text is known, that text, and a mark per update."""

    ids: list[int] = field(default_factory=list)
    text: str = ""
    marks: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])  # (tokens, text length)

    def update(self, side: _Side, ids: Sequence[int]) -> int:
        """Take the request's target tokens ``ids``; returns the length of the text that did not change."""
        keep = common_prefix(self.ids, ids)
        if keep < len(self.ids):  # tokens forgotten: back to the last mark before them
            while self.marks[-1][0] > keep:
                self.marks.pop()
            keep, length = self.marks[-1]
            del self.ids[keep:]
            self.text = self.text[:length]
        unchanged = len(self.text)
        new = list(ids[keep:])
        if side.bos is not None and keep == 0 and new[:1] == [side.bos]:
            new = new[1:]  # the target's BOS is not text: the draft's tokenizer adds its own
            self.ids.append(side.bos)
        # decoded after the tokens since the last mark before the end (they start a character: a window starting
        # inside one would decode a byte-fallback run as replacement characters); the first text alone, as the
        # tokenizer decodes a whole sequence (no leading dummy space)
        start = next(m for m, _ in reversed(self.marks) if m < len(self.ids)) if self.text else len(self.ids)
        context = self.ids[start:]
        # an incomplete character's tokens (at most 3 bytes of it) wait for the one that completes it; text that
        # still ends in U+FFFD without them has a replacement character of its own
        for held in range(min(3, len(new)) + 1):
            if held == len(new):
                return unchanged
            text = side.text_after(context, new[:len(new) - held])
            if not text.endswith("\ufffd"):
                break
        else:
            held, text = 0, side.text_after(context, new)
        self.ids += new[:len(new) - held]
        self.text += text
        self.marks.append((len(self.ids), len(self.text)))
        if len(self.marks) > _MARKS:  # the oldest go (a rollback past them decodes from the start)
            del self.marks[1: len(self.marks) - _MARKS]
        return unchanged


@dataclass
class _Draft:
    """The draft model's tokens of one request's text, and each one's character span in it."""

    ids: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)

    def update(self, side: _Side, text: str, unchanged: int) -> None:
        """Re-encode the text past the first ``unchanged`` characters (every earlier character as before)."""
        whole = bisect.bisect_right(self.spans, unchanged, key=lambda span: span[1])  # spans grow with the index
        restart = max(0, whole - _BACK)
        while restart > 0:
            first = max(0, restart - _CONTEXT)
            origin = self.spans[first][0]
            ids, offsets = side.encode(text[origin:])
            n = restart - first
            if ids[:n] == self.ids[first:restart] and len(ids) >= n and \
                    all(origin + a == self.spans[first + i][0] and origin + b == self.spans[first + i][1]
                        for i, (a, b) in enumerate(offsets[:n])):
                self.ids[restart:] = ids[n:]
                self.spans[restart:] = [(origin + a, origin + b) for a, b in offsets[n:]]
                return
            restart -= 1
        self.ids, self.spans = side.encode(text, add_special_tokens=True)


class VocabTranslator:
    """Translates each request's history to the draft model's tokens and its drafts back to the target's."""

    def __init__(self, target_tokenizer, draft_tokenizer):
        self.target = _Side(target_tokenizer)
        self.draft = _Side(draft_tokenizer)
        self._requests: dict[str, tuple[_Target, _Draft]] = {}
        # the tokens both hold (draft id -> target id): a sampled request drafts among them, its q carried over
        self.twins = _twins(target_tokenizer, draft_tokenizer)

    def to_draft(self, req_id: str, target_ids: Sequence[int]) -> list[int]:
        """The request's history (the target's tokens) as the draft model's tokens."""
        target, draft = self._requests.setdefault(req_id, (_Target(), _Draft()))
        unchanged = target.update(self.target, target_ids)
        draft.update(self.draft, target.text, unchanged)
        return draft.ids  # (the translator's own list: read before the next call)

    def to_target(self, req_id: str, drafts: list[int], target_ids: Sequence[int]) -> list[int]:
        """The draft model's ``drafts`` after the history (as :meth:`to_draft` last took it: ``target_ids``) as the
        target's tokens ([] where part of the history is not text yet: an incomplete character)."""
        target, draft = self._requests[req_id]
        cut = next((i for i, t in enumerate(drafts) if t in self.draft.special), len(drafts))
        start = max(0, len(draft.ids) - _DECODE_CONTEXT)
        while start > 0 and draft.spans[start - 1][1] > draft.spans[start][0]:
            start -= 1  # not inside a character's bytes
        text = self.draft.text_after(draft.ids[start:], drafts[:cut])
        text = text.rstrip("\ufffd")
        if not text or len(target.ids) != len(target_ids):
            return []
        committed = target.text[-_WINDOW:]
        ids, offsets = self.target.encode(committed + text)
        boundary = len(committed)
        first = next((i for i, (a, _) in enumerate(offsets) if a >= boundary), len(ids))
        if first < len(ids) and (first == 0 or offsets[first - 1][1] <= boundary):
            return ids[first:]
        return self.target.encode(text)[0]  # the target's tokenizer would merge it into the last committed token

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
