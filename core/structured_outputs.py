"""Structured outputs (vLLM's guided decoding) under speculation, torch-free. The grammars are llguidance's.

A request with ``SamplingParams.structured_outputs`` gets a :class:`RequestGrammar`: a matcher that has consumed
the request's output tokens so far. Around each step the engine uses it three times:

1. Drafts (any drafter's) enter the scheduler cut to what the grammar accepts (:meth:`RequestGrammar.constrain`).
   A greedy request drops a refused draft and everything after it. A sampled request keeps the first refused draft
   and drops only what follows it: rejection sampling accepts x with probability min(1, p'(x) / q(x)) and
   resamples from norm(max(0, p' - q)), whose output is p' (the constrained target) only averaged over every x
   that q draws; dropping the refused ones would skew it. The refused draft is then rejected for sure (p'(x) = 0).
   Where the drafter proposes fewer tokens than the grammar forces (``{"name": "`` of a JSON schema), the forced
   tokens are the drafts: free, and verified like any others.
2. Each verified position's row of the target's logits keeps only the tokens the grammar allows after the tokens
   before it, drafts on the path included (:meth:`RequestGrammar.bitmasks`: one packed row per position, 32
   tokens per int32, bit ``t % 32`` of word ``t // 32`` for token t). The plan carries them; the driver rank masks
   the rows before warping and verification, so greedy verification compares drafts with the constrained argmax
   and rejection sampling targets the constrained distribution.
3. The kept tokens advance the matcher (:meth:`RequestGrammar.advance`); once the grammar can take nothing more but
   the end of the text, the request finishes ("stop").
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from specray.sampling_params import StructuredOutputsParams
from specray.tree import DraftTree

logger = logging.getLogger(__name__)

WORD_BITS = 32


def num_words(vocab_size: int) -> int:
    """The int32 words of one packed row over ``vocab_size`` tokens."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked: :meth:`StructuredOutputs.grammar` checks it)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as err:
                raise ValueError(f"structured_outputs.json is not valid JSON ({err}); give a JSON schema") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"structured_outputs.json={schema!r} must be a JSON schema (an object)")
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _no_additional_properties(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    text = params.grammar
    if "::=" in text:  # GBNF (llama.cpp's); Lark rules use ":"
        try:
            text = any_to_lark(text)
        except Exception as err:  # the converter raises whatever its parser met: the user's grammar is at fault
            raise ValueError(f"structured_outputs.grammar is not valid GBNF: {err}") from None
    return LLMatcher.grammar_from_lark(text)


def _no_additional_properties(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _cache_key(params: StructuredOutputsParams) -> str:
    spec = getattr(params, params.kind)
    return json.dumps([params.kind, spec, params.disable_any_whitespace, params.disable_additional_properties],
                      sort_keys=True)


class StructuredOutputs:
    """The engine's grammars: one checked grammar per distinct request spec (the last ``cache_size`` kept), one
    matcher per request. The llguidance tokenizer is built from the engine's (a fast Hugging Face tokenizer) on
    the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 256):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = num_words(vocab_size)
        self._ll_tokenizer = None
        self._grammars: OrderedDict[str, str] = OrderedDict()
        self.cache_size = cache_size

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this engine has none "
                                 "(skip_tokenizer_init=True); start it with its tokenizer")
            import llguidance.hf
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=self.eos_token_ids or None)
            except ValueError as err:
                raise ValueError(f"structured_outputs needs a fast Hugging Face tokenizer: {err}") from None
        return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams) -> "RequestGrammar":
        """A fresh matcher for one request; a ValueError naming the fault when the spec is not a valid grammar."""
        from llguidance import LLMatcher

        params.check()
        tokenizer = self._tokenizer()
        key = _cache_key(params)
        text = self._grammars.get(key)
        if text is None:
            text = grammar_text(params)
            error = LLMatcher.validate_grammar(text, tokenizer)
            if error:
                raise ValueError(f"structured_outputs.{params.kind} is not a valid {params.kind} spec: "
                                 f"{error.strip()}")
            self._grammars[key] = text
            while len(self._grammars) > self.cache_size:
                self._grammars.popitem(last=False)
        else:
            self._grammars.move_to_end(key)
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error().strip()}")
        return RequestGrammar(matcher, self.words, tokenizer.vocab_size)


class RequestGrammar:
    """One request's matcher: it has consumed the request's output tokens so far (``num_tokens`` of them)."""

    def __init__(self, matcher, words: int, ll_vocab_size: int):
        self.matcher = matcher
        self.words = words
        self._ll_words = num_words(ll_vocab_size)
        self.num_tokens = 0

    # ---- the committed output ------------------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> bool:
        """Consume the output tokens the target kept; False if the grammar refuses one (its matcher then holds an
        error: it masked every position, so only a fault of ours gets here)."""
        ok = self.matcher.consume_tokens(list(tokens))
        self.num_tokens += len(tokens)
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is complete and takes nothing more but the end of the text."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its one canonical tokenization of forced text), possibly none."""
        return list(self.matcher.compute_ff_tokens())

    # ---- drafts --------------------------------------------------------------------------------------------
    def constrain(self, drafts: list[int] | DraftTree, keep_refused: bool, prefix_only: bool = True
                  ) -> tuple[list[int] | DraftTree, list[int]]:
        """``drafts`` cut to what the grammar accepts after the committed tokens, and the proposal's indices of
        the nodes kept (in order). ``keep_refused`` (a sampled request): a refused node stays, as a leaf (see the
        module docstring); else it goes. ``prefix_only``: the kept nodes are the proposal's first ones (what a
        drafter that keeps state for its nodes, or its q's rows, can follow), cut at the first node that cannot
        stay; else every node that can stay does (a tree's refused nodes leave with everything under them)."""
        if not isinstance(drafts, DraftTree):
            n = self.matcher.validate_tokens(list(drafts)) if drafts else 0
            if n < len(drafts) and keep_refused:
                n += 1
            return (drafts if n == len(drafts) else drafts[:n]), list(range(n))
        tree = drafts
        valid = self._walk(tree.token_ids, tree.parents)  # per node: the grammar accepts its path
        keep, new_index = [], {}
        for i, p in enumerate(tree.parents):
            if (p < 0 or (p in new_index and valid[p])) and (valid[i] or keep_refused):
                new_index[i] = len(keep)
                keep.append(i)
            elif prefix_only:
                break
        if len(keep) == len(tree):
            return tree, keep
        parents = [-1 if tree.parents[i] < 0 else new_index[tree.parents[i]] for i in keep]
        return DraftTree([tree.token_ids[i] for i in keep], parents,
                         None if tree.scores is None else [tree.scores[i] for i in keep], tree.wants_node_tokens), keep

    def _walk(self, token_ids: Sequence[int], parents: Sequence[int], rows: np.ndarray | None = None) -> list[bool]:
        """Visit the nodes in order, the matcher following each one's path (rolled back to the common ancestor
        of the last path, then forward). Per node: whether the grammar accepts its path; with ``rows`` given
        ([1 + k, words]), row i + 1 becomes the mask after node i (every token allowed where the path is refused:
        that node is rejected, so its row is never read). The matcher ends where it began."""
        matcher = self.matcher
        path: list[int] = []  # nodes consumed, root first
        valid: list[bool] = []
        for i, p in enumerate(parents):
            if p >= 0 and not valid[p]:
                valid.append(False)
            else:
                target = _path(parents, p)
                common = 0
                while common < min(len(path), len(target)) and path[common] == target[common]:
                    common += 1
                if len(path) > common:
                    matcher.rollback(len(path) - common)
                    del path[common:]
                ok = True
                for node in target[common:]:  # already checked, each one: they consume
                    ok = ok and matcher.consume_token(token_ids[node])
                    path.append(node)
                assert ok, (i, target)
                ok = matcher.try_consume_tokens([token_ids[i]]) == 1
                if ok:
                    path.append(i)
                valid.append(ok)
            if rows is not None:
                if valid[i]:
                    self._fill(rows, i + 1)
                else:
                    rows[i + 1] = -1
        if path:
            matcher.rollback(len(path))
        return valid

    # ---- masks ---------------------------------------------------------------------------------------------
    def bitmasks(self, drafts: Sequence[int], parents: Sequence[int] | None) -> np.ndarray:
        """[1 + k, words] int32: row 0 the mask after the committed tokens, row i + 1 after draft node i's path
        (a chain when ``parents`` is None)."""
        rows = np.zeros((1 + len(drafts), self.words), dtype=np.int32)
        self._fill(rows, 0)
        if drafts:
            self._walk(drafts, list(range(-1, len(drafts) - 1)) if parents is None else parents, rows)
        return rows

    def _fill(self, rows: np.ndarray, index: int) -> None:
        if self._ll_words == self.words:
            self.matcher.unsafe_compute_mask_ptr(rows[index].ctypes.data, self.words * 4)
            return
        row = np.zeros(self._ll_words, dtype=np.int32)  # the tokenizer's vocabulary is not the model's
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._ll_words * 4)
        n = min(self._ll_words, self.words)
        rows[index, :n] = row[:n]
        rows[index, n:] = 0


def _path(parents: Sequence[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def allowed_tokens(row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids one packed row allows (tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:vocab_size])]
