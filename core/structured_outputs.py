"""Structured outputs (vLLM's guided decoding) under speculation, torch-free. The grammars are llguidance's.

A request with ``SamplingParams.structured_outputs`` gets a :class:`RequestGrammar`: a matcher that has consumed
the request's output tokens so far. Around each step the engine uses it three times:

1. Drafts (any drafter's) enter the scheduler cut to what the grammar accepts (:meth:`RequestGrammar.constrain`).
   A greedy request drops a refused draft and everything after it. A sampled request keeps the first refused draft
   and drops only what follows it: rejection sampling accepts x with probability min(1, p'(x) / q(x)) and
   resamples from norm(max(0, p' - q)), whose output is p' (the constrained target) only averaged over every x
   that q draws; dropping the refused ones would skew it. The refused draft is then rejected for sure (p'(x) = 0).
   Where the drafts do not begin with all the tokens the grammar forces next (``{"name": "`` of a JSON schema),
   the forced tokens are the drafts: free, and verified like any others. (A draft model drafts under the grammar
   itself: ``specray.drafters.draft_model``.)
2. Each verified position's row of the target's logits keeps only the tokens the grammar allows after the tokens
   before it, drafts on the path included (:meth:`RequestGrammar.bitmasks`: one packed row per position, 32
   tokens per int32, bit ``t % 32`` of word ``t // 32`` for token t). The plan carries them; the driver rank masks
   the rows before warping and verification, so greedy verification compares drafts with the constrained argmax
   and rejection sampling targets the constrained distribution.
3. The kept tokens advance the matcher (:meth:`RequestGrammar.advance`); once the grammar can take nothing more but
   the end of the text, the request finishes ("stop").

A reasoning model (``EngineArgs.reasoning_parser``, vLLM's ``--reasoning-parser``) thinks freely first: the grammar
governs only what follows the output's first ``</think>`` (every position before it, and that token, unmasked;
drafts past it on a path are checked from there). Where the output starts: inside the thinking phase for
``deepseek_r1``; for ``qwen3`` unless the prompt's last thinking tag is ``</think>`` (Qwen3 with
``enable_thinking=False``: its template closes an empty thinking phase in the prompt, and the grammar governs the
whole output).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from specray.sampling_params import StructuredOutputsParams
from specray.tree import DraftTree, path_to

WORD_BITS = 32
# vLLM's reasoning parsers: each one's thinking tags, and whether the output starts inside the thinking phase
# whatever the prompt says ("always") or only where the prompt leaves it open ("open")
REASONING_PARSERS = {"deepseek_r1": ("<think>", "</think>", "always"), "qwen3": ("<think>", "</think>", "open")}


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not known; choose one of {list(REASONING_PARSERS)} (both "
                         "split <think> ... </think> from the answer) or leave it unset")


def num_words(vocab_size: int) -> int:
    """The int32 words of one packed row over ``vocab_size`` tokens."""
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked: :meth:`StructuredOutputs.compile` checks it)."""
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
    """The engine's grammars: one compiled grammar per distinct request spec (a fresh matcher, the last
    ``cache_size`` kept), and per request a copy of it. The llguidance tokenizer is built from the engine's (a fast
    Hugging Face tokenizer) on the first structured request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = 128,
                 reasoning_parser: str | None = None):
        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self._thinking_ids: tuple[int, int] | None = None  # the parser's (begin, end) token ids, looked up once
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = num_words(vocab_size)
        self._ll_tokenizer = None
        self._templates: OrderedDict[str, object] = OrderedDict()  # spec -> a fresh matcher of its grammar
        self.cache_size = cache_size
        self._executor = None  # llguidance's thread pool for a step's chain masks, made on first use
        # compile() may run in other threads (the async engine's callers) beside the engine's: the lock guards the
        # templates and the tokenizer, never a compilation (llguidance releases the GIL while it compiles)
        self._lock = threading.Lock()

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                if self.tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this engine has none "
                                     "(skip_tokenizer_init=True); start it with its tokenizer")
                import llguidance.hf
                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer,
                                                                      eos_token=self.eos_token_ids or None)
                except ValueError as err:
                    raise ValueError(f"structured_outputs needs a fast Hugging Face tokenizer: {err}") from None
            return self._ll_tokenizer

    def thinking_ids(self) -> tuple[int, int] | None:
        """The reasoning parser's (begin, end) thinking tokens (None without a parser); a ValueError when the
        tokenizer has no such single tokens."""
        if self.reasoning_parser is None:
            return None
        if self._thinking_ids is None:
            begin, end, _ = REASONING_PARSERS[self.reasoning_parser]
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            missing = [t for t in (begin, end) if t not in vocab]
            if missing:
                raise ValueError(f"reasoning_parser={self.reasoning_parser!r} needs the tokens {missing} in the "
                                 "model's tokenizer, which has none: leave reasoning_parser unset for this model")
            self._thinking_ids = (vocab[begin], vocab[end])
        return self._thinking_ids

    def _thinks_first(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the output starts inside the thinking phase (the reasoning parser's rule, see the module
        docstring)."""
        ids = self.thinking_ids()
        if ids is None:
            return False
        if REASONING_PARSERS[self.reasoning_parser][2] == "always":
            return True
        begin, end = ids
        last = {begin: -2, end: -2}
        for i, t in enumerate(prompt_token_ids):
            if t in last:
                last[t] = i
        return not last[end] > last[begin]

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of ``params`` (a fresh matcher, kept for the next request with the same spec); a
        ValueError naming the fault when the spec is not a valid grammar. Thread-safe: the async engine compiles a
        new spec in its caller's thread, so the engine's step loop does not wait for it."""
        from llguidance import LLMatcher

        params.check()
        tokenizer = self._tokenizer()
        key = _cache_key(params)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        template = LLMatcher(tokenizer, grammar_text(params), log_level=0)  # once per spec
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is not a valid {params.kind} spec: "
                             f"{template.get_error().strip()}")
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
        return template

    def grammar(self, params: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()) -> "RequestGrammar":
        """A fresh matcher for one request; a ValueError naming the fault when the spec is not a valid grammar.
        With a reasoning parser, the grammar waits for the end of the thinking phase where the output starts
        inside it."""
        tokenizer = self._tokenizer()
        matcher = self.compile(params).deep_copy()  # a copy of the compiled grammar, not a new compilation
        thinking = self._thinks_first(prompt_token_ids)
        return RequestGrammar(matcher, self.words, tokenizer.vocab_size,
                              self.thinking_ids()[1] if thinking else None)

    def step_bitmasks(self, chunks: list[tuple["RequestGrammar", list[int], list[int] | None]]) -> list[np.ndarray]:
        """Each chunk's :meth:`RequestGrammar.bitmasks` (a grammar, its drafts, their tree's parents or None for a
        chain), the chains' of active grammars computed together on llguidance's thread pool (one row per
        position, over as many threads as the machine gives), the rest one by one."""
        from llguidance import LLExecutor
        from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

        out: list[np.ndarray | None] = [None] * len(chunks)
        pooled = [i for i, (g, drafts, parents) in enumerate(chunks) if parents is None and g.active and drafts
                  and g._ll_words == self.words]  # (the pool takes no chain without drafts)
        in_pool = set(pooled)
        for i, (grammar, drafts, parents) in enumerate(chunks):
            if i not in in_pool:
                out[i] = grammar.bitmasks(drafts, parents)
        if pooled:
            starts, total = [], 0
            for i in pooled:
                starts.append(total)
                total += 1 + len(chunks[i][1])
            rows = np.full((total, self.words), -1, dtype=np.int32)
            if self._executor is None:
                self._executor = LLExecutor()
            fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, [(chunks[i][0].matcher, start, list(chunks[i][1])) for i, start in zip(pooled, starts)],
                rows)
            for i, start in zip(pooled, starts):
                grammar, drafts, _ = chunks[i]
                block = rows[start:start + 1 + len(drafts)]
                if drafts and grammar.matcher.validate_tokens(list(drafts)) < len(drafts):
                    block[len(drafts)] = -1  # a sampled request's refused last draft: its row is never read
                out[i] = block
        return out


class RequestGrammar:
    """One request's matcher: it has read the request's output tokens so far (``num_tokens`` of them). With
    ``end_of_thinking``, the output starts in a reasoning model's thinking phase: the grammar governs only what
    follows the first such token (``active`` from then on)."""

    def __init__(self, matcher, words: int, ll_vocab_size: int, end_of_thinking: int | None = None):
        self.matcher = matcher
        self.words = words
        self._ll_words = num_words(ll_vocab_size)
        self.num_tokens = 0
        self.end_of_thinking = end_of_thinking
        self.active = end_of_thinking is None
        self._activated_at: int | None = None  # where the thinking ended (num_tokens after that token)

    # ---- the committed output ------------------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> bool:
        """Read the output tokens the target kept (``num_tokens`` counts them all); False if the grammar refuses
        one (its matcher then holds an error; it masked every position, so the request's own constraints, such as
        ``allowed_token_ids``, left it no token, or a fault of ours)."""
        tokens = list(tokens)
        start = self.num_tokens
        self.num_tokens += len(tokens)
        if not self.active:
            if self.end_of_thinking not in tokens:
                return True
            self.active = True
            end = tokens.index(self.end_of_thinking) + 1
            self._activated_at = start + end
            tokens = tokens[end:]
        return self.matcher.consume_tokens(tokens) if tokens else True

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens read (the matcher's, and the end of the thinking among them)."""
        assert 0 <= num_tokens <= self.num_tokens, (num_tokens, self.num_tokens)
        keep = self.num_tokens - num_tokens
        if self.active and self._activated_at is not None and keep < self._activated_at:
            read = self.num_tokens - self._activated_at  # all the matcher read since the thinking ended
            self.active, self._activated_at = False, None
        else:
            read = num_tokens if self.active else 0
        if read:
            self.matcher.rollback(read)
        self.num_tokens = keep

    def mask_row(self) -> np.ndarray:
        """[words] int32: the tokens the grammar allows next (all of them while thinking)."""
        rows = np.full((1, self.words), -1, dtype=np.int32)
        if self.active:
            self._fill(rows, 0)
        return rows[0]

    @property
    def terminated(self) -> bool:
        """The grammar is complete and takes nothing more but the end of the text."""
        return self.active and self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (its one canonical tokenization of forced text), possibly none."""
        return list(self.matcher.compute_ff_tokens()) if self.active else []

    # ---- drafts --------------------------------------------------------------------------------------------
    def constrain(self, drafts: list[int] | DraftTree, keep_refused: bool, prefix_only: bool = True
                  ) -> tuple[list[int] | DraftTree, list[int]]:
        """``drafts`` cut to what the grammar accepts after the committed tokens, and the proposal's indices of
        the nodes kept (in order). ``keep_refused`` (a sampled request): a refused node stays, as a leaf (see the
        module docstring); else it goes. ``prefix_only``: the kept nodes are the proposal's first ones (what a
        drafter that keeps state for its nodes, or its q's rows, can follow), cut at the first node that cannot
        stay; else every node that can stay does (a tree's refused nodes leave with everything under them)."""
        if not isinstance(drafts, DraftTree):
            start = 0  # the drafts the grammar governs start here
            if not self.active:
                if self.end_of_thinking not in drafts:
                    return drafts, list(range(len(drafts)))
                start = list(drafts).index(self.end_of_thinking) + 1
            n = start + (self.matcher.validate_tokens(list(drafts[start:])) if len(drafts) > start else 0)
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
        """Visit the nodes in order, the matcher following each one's path (rolled back to the common part with
        the last path, then forward). Per node: whether the grammar accepts its path; with ``rows`` given
        ([1 + k, words]), row i + 1 becomes the mask after node i (every token allowed where the path is refused:
        that node is rejected, so its row is never read; and where the path is still thinking). The matcher ends
        where it began."""
        matcher = self.matcher
        at: list[int] = []  # the nodes the matcher has consumed, in order
        valid: list[bool] = []
        for i, p in enumerate(parents):
            governed = None if p >= 0 and not valid[p] else self._governed(path_to(parents, i), token_ids)
            if governed is None:  # under a refused node (invalid), or still thinking (free)
                valid.append(p < 0 or valid[p])
                if rows is not None:
                    rows[i + 1] = -1
                continue
            own = bool(governed) and governed[-1] == i
            before = governed[:-1] if own else governed
            common = 0
            while common < min(len(at), len(before)) and at[common] == before[common]:
                common += 1
            if len(at) > common:
                matcher.rollback(len(at) - common)
                del at[common:]
            for node in before[common:]:  # each one already checked: they consume
                consumed = matcher.consume_token(token_ids[node])
                assert consumed, (i, before)
                at.append(node)
            ok = True
            if own:
                ok = matcher.try_consume_tokens([token_ids[i]]) == 1
                if ok:
                    at.append(i)
            valid.append(ok)
            if rows is not None:
                if ok:
                    self._fill(rows, i + 1)
                else:
                    rows[i + 1] = -1
        if at:
            matcher.rollback(len(at))
        return valid

    def _governed(self, path: list[int], token_ids: Sequence[int]) -> list[int] | None:
        """The nodes of ``path`` the grammar reads: all of them once active, else those after the first end of the
        thinking phase on it (None: it has none, so the path is still thinking)."""
        if self.active:
            return path
        for j, node in enumerate(path):
            if token_ids[node] == self.end_of_thinking:
                return path[j + 1:]
        return None

    # ---- masks ---------------------------------------------------------------------------------------------
    def bitmasks(self, drafts: Sequence[int], parents: Sequence[int] | None) -> np.ndarray:
        """[1 + k, words] int32: row 0 the mask after the committed tokens, row i + 1 after draft node i's path
        (a chain when ``parents`` is None)."""
        rows = np.zeros((1 + len(drafts), self.words), dtype=np.int32)
        if self.active:
            self._fill(rows, 0)
        else:
            rows[0] = -1
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


def allowed_tokens(row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids one packed row allows (tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype=np.int32).view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:vocab_size])]
