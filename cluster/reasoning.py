"""Reasoning content (vLLM's ``--reasoning-parser``): a reasoning model's thinking, between ``<think>`` and
``</think>``, goes to a chat message's ``reasoning_content``, the rest to its ``content``; streamed, each delta
carries the part of the new text that belongs to either, the tags left out.

Where the output starts: inside the thinking phase for ``deepseek_r1`` (DeepSeek-R1's template opens it in the
prompt, or the model is trained to think first and may omit the opening tag), and for ``qwen3`` when the rendered
prompt ends inside an open ``<think>`` (else outside it, so that Qwen3 with ``enable_thinking=False``, whose template
closes an empty thinking phase in the prompt, answers in ``content``). A tag may arrive split over several deltas:
a tail of the new text that could begin one is held until the next delta (or the end) tells.
"""

from __future__ import annotations

from specray.structured_outputs import REASONING_PARSERS as _PARSERS
from specray.structured_outputs import check_reasoning_parser  # noqa: F401 (the server's check is the engine's)

REASONING_PARSERS = tuple(_PARSERS)  # the engine's (its structured outputs wait for the end of the thinking)
BEGIN, END = "<think>", "</think>"


def tags_are_special(tokenizer) -> bool:
    """Whether ``tokenizer`` holds ``<think>`` or ``</think>`` as a special token: text decoded with special tokens
    skipped (a request's default) would lose the tags the split looks for."""
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    if to_id is None:  # not an HF tokenizer: no special tokens to tell apart
        return False
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special = set(getattr(tokenizer, "all_special_ids", ()))
    for tag in (BEGIN, END):
        token_id = to_id(tag)
        if isinstance(token_id, int) and token_id != getattr(tokenizer, "unk_token_id", None) and (
                token_id in special or getattr(added.get(token_id), "special", False)):
            return True
    return False


def reasoning_tokens(tokenizer, token_ids: list[int], reasoning: str | None, thinking_first: bool) -> int:
    """How many of an output's tokens are its thinking (the tags' included; ``reasoning``: its text, None when it
    had none): counted by the tags' token ids where each tag is one token of ``tokenizer`` (Qwen3's, DeepSeek-R1's),
    else the reasoning's text encoded again (a close count, at most the output's). ``thinking_first``: the output
    starts thinking."""
    if reasoning is None:
        return 0
    to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
    tags = [] if to_id is None else [to_id(tag) for tag in (BEGIN, END)]
    if tags and all(isinstance(t, int) and t != getattr(tokenizer, "unk_token_id", None) for t in tags):
        begin, end = tags
        start = 0 if thinking_first else next((i for i, t in enumerate(token_ids) if t == begin), None)
        if start is not None:
            return next((i + 1 for i in range(start, len(token_ids)) if token_ids[i] == end), len(token_ids)) - start
    return min(len(tokenizer.encode(reasoning, add_special_tokens=False)), len(token_ids))


def starts_thinking(parser: str, prompt_text: str | None) -> bool:
    """Whether a response to ``prompt_text`` (the rendered chat) starts inside the thinking phase."""
    if parser == "deepseek_r1":
        return True
    text = prompt_text or ""
    return text.rfind(BEGIN) > text.rfind(END)


class ReasoningSplitter:
    """Splits one choice's text, pushed delta by delta, into (reasoning, content)."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self.saw_reasoning = thinking
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and the content in ``text`` (after what an earlier push held back)."""
        text, self._held = self._held + text, ""
        reasoning, content = [], []
        while text:
            tag = END if self.thinking else BEGIN
            part = reasoning if self.thinking else content
            at = text.find(tag)
            if at >= 0:
                part.append(text[:at])
                text = text[at + len(tag):]
                self.thinking = not self.thinking
                self.saw_reasoning = True
                continue
            keep = _tag_start(text, tag)
            part.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, as the phase the text ended in (no tag completed it)."""
        held, self._held = self._held, ""
        return (held, "") if self.thinking else ("", held)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole text as the message's (reasoning_content, content): None for a part that never began (no
        thinking phase; an answer that never came because the thinking never ended)."""
        r1, c1 = self.push(text)
        r2, c2 = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        ended_thinking = self.thinking
        return (reasoning if self.saw_reasoning else None), (None if ended_thinking and not content else content)


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest tail of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
