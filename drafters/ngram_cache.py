"""``ngram_cache``: llama.cpp's ``--spec-type ngram-cache`` (its lookup decoding). Torch-free.

Three tables map an n-gram to the counts of the tokens that followed it:

* **context** (per request): every n-gram of 1..4 tokens of the request's history (llama.cpp's
  ``LLAMA_NGRAM_MIN..MAX``), kept incrementally (each new token adds 4 counts, a rewind takes them back).
* **dynamic** (per engine, ``use_dynamic_cache``): the context tables of finished requests, merged in as each
  finishes (llama.cpp's lookup merges its context cache into the dynamic one after a generation). Bounded by
  ``max_dynamic_ngrams`` (the n-grams first added go first).
* **static** (``static_cache_path``): counts of ``S``-token n-grams (llama.cpp's ``LLAMA_NGRAM_STATIC`` = 2) from
  a large corpus, read from a file (format below) and never changed.

Drafting one token after the history (plus the tokens drafted so far), llama.cpp's rule:

1. ``part`` = the static counts after the last S tokens (empty if unknown).
2. From the context table, trying the longest n-gram first (4 down to 1): among the tokens that followed it pick
   the one with the largest ``count * (100 * static count if the static part has it else 1)``; take it if the
   n-gram's total count is at least ``MIN_SAMPLES_LAX[n-1]`` and the pick's count is at least
   ``MIN_PERCENT_LAX[n-1]`` percent of that total; else try the next shorter n-gram.
3. If nothing: the same with the dynamic table and the stricter ``*_STRICT`` thresholds.
4. If nothing: the static table alone: its most frequent token after the last S tokens, if they were seen at
   least ``MIN_SAMPLES_LAX[S-1]`` times and it has ``MIN_PERCENT_LAX[S-1]`` percent of them.
5. If still nothing, stop; else append the token and draft the next one, up to the draft count.

A proposal is a chain; ``scores`` give each token's share of its deciding table's counts, ``key`` the size of the
n-gram that decided the first token. Ties between equal products go to the token seen first.

Static cache file (little-endian, all fields 32-bit unless said):

    header   "<8sHHII": magic b"SPRNGC\\x00\\x01", version (u16) = 1, ngram_size S (u16, 1..4),
             num_entries E (u32), num_pairs P (u32)
    body     E entries, int32 each: S tokens of the n-gram, K = number of next tokens (>= 1), then K pairs
             (token, count >= 1); the K of all entries add up to P, so the file is exactly
             20 + 4 * (E * (S + 1) + 2 * P) bytes

:func:`build_static_cache` counts the n-grams of token sequences and :func:`save_static_cache` writes them;
:func:`load_static_cache` reads and checks a file (a ValueError names the file and the problem).

Differences from llama.cpp (deliberate): the context table counts every n-gram ending at each new token
(llama.cpp's server variant misses those spanning two updates); n-grams longer than the history are skipped
(llama.cpp reads before its start); a request that was preempted and comes back is merged into the dynamic
table only for the tokens it added since (finish is called for both).
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from specray.config import SpeculativeConfig
from specray.drafters.base import DrafterContext, Proposal
from specray.drafters.ngram_common import LookupDrafter, LookupState, check_bool, check_int

logger = logging.getLogger(__name__)

METHOD = "ngram_cache"
NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2  # llama.cpp's LLAMA_NGRAM_MIN / MAX / STATIC
# Per n-gram size 1..4: the least total count and the least percentage of it for the pick to be drafted.
MIN_SAMPLES_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLES_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)
STATIC_WEIGHT = 100  # a token the static table knows weighs 100 x its static count

MAGIC = b"SPRNGC\x00\x01"
VERSION = 1
_HEADER = struct.Struct("<8sHHII")
_MERGED_RECORDS = 4096  # finished request ids remembered (how much of their history the dynamic table holds)

Counts = dict[tuple[int, ...], dict[int, int]]  # n-gram -> {next token: count}


@dataclass
class NgramCacheOptions:
    """``speculative_config`` keys of ``method="ngram_cache"``."""

    static_cache_path: str | None = None  # llama.cpp's --lookup-cache-static (format in the module docstring)
    use_dynamic_cache: bool = True  # learn across requests: finished requests' counts join a shared table
    max_dynamic_ngrams: int | None = None  # n-grams the dynamic table keeps (the first added go first); None: 2^20

    def __post_init__(self) -> None:
        if self.static_cache_path is not None and (not isinstance(self.static_cache_path, (str, os.PathLike))
                                                   or not str(self.static_cache_path)):
            raise ValueError(f"speculative_config.static_cache_path={self.static_cache_path!r} must be the path of "
                             f"a static n-gram cache file (build one with specray.drafters.ngram_cache."
                             f"build_static_cache) or None for method={METHOD!r}")
        check_bool(METHOD, "use_dynamic_cache", self.use_dynamic_cache)
        if self.max_dynamic_ngrams is not None and self.use_dynamic_cache is False:
            raise ValueError(f"speculative_config.max_dynamic_ngrams={self.max_dynamic_ngrams!r} bounds the dynamic "
                             f"table, which use_dynamic_cache=False turns off for method={METHOD!r}; remove it, or "
                             "set use_dynamic_cache=True")
        if self.max_dynamic_ngrams is None:
            self.max_dynamic_ngrams = 1 << 20
        check_int(METHOD, "max_dynamic_ngrams", self.max_dynamic_ngrams, 1, what="n-grams the dynamic table keeps")


# ---------------------------------------------------------------------------------------------- counting


def add_counts(counts: Counts, tokens: Sequence[int], start: int, sizes: Iterable[int]) -> None:
    """Count, for each position ``t >= start``, the n-grams of each size ending just before it -> ``tokens[t]``."""
    sizes = tuple(sizes)
    for t in range(start, len(tokens)):
        token = tokens[t]
        for n in sizes:
            if n > t:
                break
            gram = tuple(tokens[t - n:t])
            part = counts.get(gram)
            if part is None:
                counts[gram] = {token: 1}
            else:
                part[token] = part.get(token, 0) + 1


def remove_counts(counts: Counts, tokens: Sequence[int], start: int, sizes: Iterable[int]) -> None:
    """Undo :func:`add_counts` for the positions ``t >= start``."""
    sizes = tuple(sizes)
    for t in range(len(tokens) - 1, start - 1, -1):
        token = tokens[t]
        for n in sizes:
            if n > t:
                break
            gram = tuple(tokens[t - n:t])
            part = counts[gram]
            left = part[token] - 1
            if left:
                part[token] = left
            else:
                del part[token]
                if not part:
                    del counts[gram]


def build_static_cache(sequences: Iterable[Sequence[int]], ngram_size: int = NGRAM_STATIC) -> Counts:
    """Counts of every ``ngram_size``-token n-gram of ``sequences`` -> the token after it (a static cache)."""
    check_int(METHOD, "ngram_size", ngram_size, NGRAM_MIN, NGRAM_MAX, what="static n-gram size")
    counts: Counts = {}
    for tokens in sequences:
        add_counts(counts, list(tokens), 0, (ngram_size,))
    return counts


def save_static_cache(counts: Mapping[tuple[int, ...], Mapping[int, int]], path: str | os.PathLike) -> None:
    """Write ``counts`` (all n-grams of one size, 1..4) in the static cache format (module docstring)."""
    sizes = {len(gram) for gram in counts}
    if len(sizes) > 1 or not sizes <= set(range(NGRAM_MIN, NGRAM_MAX + 1)):
        raise ValueError(f"a static n-gram cache holds n-grams of one size in 1..{NGRAM_MAX}; "
                         f"got sizes {sorted(sizes)}")
    size = sizes.pop() if sizes else NGRAM_STATIC
    body = array("i")
    pairs = 0
    for gram, part in counts.items():
        if not part or any(count < 1 for count in part.values()):
            raise ValueError(f"n-gram {gram} has no positive counts ({dict(part)}); drop it or count it")
        body.extend(gram)
        body.append(len(part))
        for token, count in part.items():
            body.extend((token, count))
        pairs += len(part)
    if sys.byteorder != "little":
        body.byteswap()
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, size, len(counts), pairs))
        f.write(body.tobytes())


def load_static_cache(path: str | os.PathLike) -> tuple[int, Counts]:
    """Read and check a static cache file: ``(ngram_size, counts)``. A ValueError names the file and the fault."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"speculative_config.static_cache_path={str(path)!r} cannot be read ({err.strerror}); "
                         "give an existing file written by specray.drafters.ngram_cache.save_static_cache") from None
    size, entries, pairs = _check_header(path, data)
    body = array("i")
    body.frombytes(data[_HEADER.size:])
    if sys.byteorder != "little":
        body.byteswap()
    return size, _parse_body(path, body, size, entries)


def _corrupt(path, problem: str) -> ValueError:
    return ValueError(f"static n-gram cache {str(path)!r} is corrupt: {problem}; rebuild it with "
                      "specray.drafters.ngram_cache.build_static_cache and save_static_cache")


def _check_header(path, data: bytes) -> tuple[int, int, int]:
    if len(data) < _HEADER.size:
        raise _corrupt(path, f"{len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, size, entries, pairs = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise _corrupt(path, f"it does not start with {MAGIC!r} (not a specray static n-gram cache)")
    if version != VERSION:
        raise _corrupt(path, f"format version {version} is not {VERSION}")
    if not NGRAM_MIN <= size <= NGRAM_MAX:
        raise _corrupt(path, f"n-gram size {size} is not in {NGRAM_MIN}..{NGRAM_MAX}")
    expected = _HEADER.size + 4 * (entries * (size + 1) + 2 * pairs)
    if len(data) != expected:
        raise _corrupt(path, f"{len(data)} bytes where the header promises {expected} (truncated or padded)")
    return size, entries, pairs


def _parse_body(path, body: array, size: int, entries: int) -> Counts:
    counts: Counts = {}
    i = 0
    for _ in range(entries):
        gram = tuple(body[i:i + size])
        num = body[i + size]
        i += size + 1
        if num < 1 or i + 2 * num > len(body):
            raise _corrupt(path, f"n-gram {gram} claims {num} next tokens")
        part = dict(zip(body[i:i + 2 * num:2], body[i + 1:i + 2 * num:2]))
        i += 2 * num
        if len(part) != num or min(part.values()) < 1 or min(gram + tuple(part)) < 0:
            raise _corrupt(path, f"n-gram {gram} has repeated or negative tokens or non-positive counts")
        if gram in counts:
            raise _corrupt(path, f"n-gram {gram} appears twice")
        counts[gram] = part
    if i != len(body):
        raise _corrupt(path, "the entries do not fill the body")
    return counts


# ---------------------------------------------------------------------------------------------- drafting


def _pick(part: Mapping[int, int], static_part: Mapping[int, int]) -> tuple[int, int, int]:
    """The token with the largest count x static weight: ``(token, its count, the part's total)``."""
    best_token, best_count, best_score, total = -1, 0, 0, 0
    for token, count in part.items():
        weight = STATIC_WEIGHT * static_part[token] if token in static_part else 1
        if count * weight > best_score:
            best_token, best_count, best_score = token, count, count * weight
        total += count
    return best_token, best_count, total


def _passes(count: int, total: int, n: int, min_samples: Sequence[int], min_percent: Sequence[int]) -> bool:
    return total >= min_samples[n - 1] and 100 * count >= min_percent[n - 1] * total


def _try_primary(table: Mapping, seq: Sequence[int], static_part: Mapping[int, int], min_samples, min_percent):
    """Step 2/3 of the module docstring: ``(token, n, share)`` or None."""
    for n in range(min(NGRAM_MAX, len(seq)), NGRAM_MIN - 1, -1):
        part = table.get(tuple(seq[-n:]))
        if part:
            token, count, total = _pick(part, static_part)
            if _passes(count, total, n, min_samples, min_percent):
                return token, n, count / total
    return None


def _try_static(part: Mapping[int, int], size: int):
    """Step 4: ``(token, size, share)`` or None."""
    if not part:
        return None
    token, count, total = _pick(part, {})
    return (token, size, count / total) if _passes(count, total, size, MIN_SAMPLES_LAX, MIN_PERCENT_LAX) else None


def draft_chain(history: Sequence[int], k: int, context: Mapping, dynamic: Mapping, static: Mapping,
                static_size: int) -> tuple[list[int], list[float], int | None]:
    """Up to ``k`` tokens after ``history`` by the rule of the module docstring: ``(tokens, shares, key)``."""
    seq = list(history[-NGRAM_MAX:])
    tokens: list[int] = []
    shares: list[float] = []
    key = None
    while len(tokens) < k:
        static_part = static.get(tuple(seq[-static_size:]), {}) if len(seq) >= static_size else {}
        found = (_try_primary(context, seq, static_part, MIN_SAMPLES_LAX, MIN_PERCENT_LAX)
                 or _try_primary(dynamic, seq, static_part, MIN_SAMPLES_STRICT, MIN_PERCENT_STRICT)
                 or _try_static(static_part, static_size))
        if found is None:
            break
        token, n, share = found
        key = n if key is None else key
        tokens.append(token)
        shares.append(share)
        seq.append(token)
        if len(seq) > NGRAM_MAX:
            del seq[0]
    return tokens, shares, key


# ---------------------------------------------------------------------------------------------- the drafter


class CacheState(LookupState):
    """A request's context table: every n-gram of 1..4 tokens of its history -> the counts of what followed."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counts = {}

    def advance(self, start: int) -> None:
        add_counts(self.counts, self.tokens, start, range(NGRAM_MIN, NGRAM_MAX + 1))

    def rewind(self, kept: int) -> None:
        remove_counts(self.counts, self.tokens, kept, range(NGRAM_MIN, NGRAM_MAX + 1))


class NgramCacheDrafter(LookupDrafter):
    """llama.cpp's lookup decoding: context, dynamic and static n-gram statistics."""

    name = METHOD

    def __init__(self, spec: SpeculativeConfig, ctx: DrafterContext):
        super().__init__(spec, ctx)
        self.static: Counts = {}
        self.static_size = NGRAM_STATIC
        if self.options.static_cache_path is not None:
            self.static_size, self.static = load_static_cache(self.options.static_cache_path)
            logger.info("ngram_cache: loaded %d %d-grams from %s", len(self.static), self.static_size,
                        self.options.static_cache_path)
        self.dynamic: OrderedDict[tuple[int, ...], dict[int, int]] = OrderedDict()
        self._merged: OrderedDict[str, tuple[int, int]] = OrderedDict()  # req_id -> (tokens merged, their hash)

    def _new_state(self) -> CacheState:
        return CacheState()

    def _draft(self, state: CacheState, k: int) -> Proposal:
        tokens, shares, key = draft_chain(state.tokens, k, state.counts, self.dynamic, self.static,
                                          self.static_size)
        return Proposal(tokens, key=key, scores=shares if tokens else None)

    def _on_finish(self, req_id: str, state: CacheState) -> None:
        """Merge what this request added since it was last merged (a preempted one comes back with its id)."""
        if not self.options.use_dynamic_cache:
            return
        tokens = state.tokens
        done, digest = self._merged.pop(req_id, (0, 0))
        if done > len(tokens) or hash(tuple(tokens[:done])) != digest:
            done = 0  # another request under the same id, or a rewound one: merge it all
        add_counts(self.dynamic, tokens, done, range(NGRAM_MIN, NGRAM_MAX + 1))
        self._merged[req_id] = (len(tokens), hash(tuple(tokens)))
        while len(self._merged) > _MERGED_RECORDS:
            self._merged.popitem(last=False)
        while len(self.dynamic) > self.options.max_dynamic_ngrams:
            self.dynamic.popitem(last=False)

    def _extra_stats(self) -> dict:
        return {"static_ngrams": len(self.static), "dynamic_ngrams": len(self.dynamic)}
