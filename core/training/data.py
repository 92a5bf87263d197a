"""Training text for a draft head, written by the target itself (no corpus, no download).

Two stages, each resumable (it appends to its file and, started again, goes on after the last complete record):

1. **Prompts** (``prompts.jsonl``): Magpie-style. The target's chat template is cut just where a user's message
   would begin (``<|im_start|>user\\n`` after the system turn, for SmolLM2), and the target samples what a user
   would write there. Or the lines of a prompt file of the user's own.
2. **Answers** (``samples.jsonl``): each prompt through the chat template, answered greedily by the target through
   specray's own batched engine. A record holds the whole token sequence (template + prompt + answer) and where
   the answer starts.

The text is the target's own, so a head trained on it learns what the target says, which is what it must guess.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.jsonl"
SAMPLES_FILE = "samples.jsonl"
_MARK = "\x00specray-user-message\x00"


@dataclass
class DataConfig:
    num_prompts: int = 2000
    prompt_file: str | None = None  # one prompt per line (plain text or {"prompt": ...}); None: Magpie prompts
    prompt_max_tokens: int = 64
    prompt_temperature: float = 1.0
    prompt_top_p: float = 0.95
    answer_max_tokens: int = 256
    batch_size: int = 64  # prompts generated per round (one append to the file per round)
    max_num_seqs: int = 32  # the engine's batch
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prompts", "prompt_max_tokens", "answer_max_tokens", "batch_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.prompt_file is not None and not os.path.isfile(self.prompt_file):
            raise ValueError(f"prompt_file={self.prompt_file!r} is not a file; give a file of prompts, one per line")


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user's first message begins (Magpie's pre-query template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template: give prompts with --prompt-file")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False,
                                         add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the chat template does not show a user's message verbatim: give prompts with --prompt-file")
    return text[: text.index(_MARK)]


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file (a last line cut short by a stopped run is dropped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # the run stopped while writing it
            records.append(json.loads(line))
    return records


def _append(path: str, records: list[dict[str, Any]]) -> None:
    _trim_partial_line(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def _trim_partial_line(path: str) -> None:
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)


def _prompts_from_file(path: str) -> list[str]:
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: a line starting with '{{' must be a JSON object "
                                     f"{{\"prompt\": \"...\"}} ({err.msg} at column {err.colno}); write a "
                                     "prompt that starts with '{' as one") from None
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise ValueError(f"{path}:{n}: expected a line of text or {{\"prompt\": \"...\"}}")
                line = item["prompt"]
            prompts.append(line)
    if not prompts:
        raise ValueError(f"prompt_file={path!r} holds no prompts")
    return prompts


def kept_prompts(config: DataConfig, out_dir: str) -> list[str]:
    """The prompts ``out_dir`` already holds (a run goes on from them), no more than ``config.num_prompts``: its
    samples answer every one, and training reads them all, so a smaller ``num_prompts`` would be ignored (a
    ValueError)."""
    path = os.path.join(out_dir, PROMPTS_FILE)
    have = [r["prompt"] for r in read_jsonl(path)]
    if len(have) > config.num_prompts:
        raise ValueError(f"{path} already holds {len(have)} prompts, more than num_prompts={config.num_prompts}, "
                         "and training reads every sample made from them: run with --num-prompts "
                         f"{len(have)} (or more) to go on with them, or give another --out for fewer")
    return have


def file_prompts(config: DataConfig, out_dir: str) -> list[str]:
    """The prompts of ``config.prompt_file`` (its first ``num_prompts``), checked to begin with those ``out_dir``
    already holds (its samples answer them): a ValueError otherwise, or for a file of no or malformed prompts."""
    path = os.path.join(out_dir, PROMPTS_FILE)
    have = kept_prompts(config, out_dir)
    wanted = _prompts_from_file(config.prompt_file)[: config.num_prompts]
    differ = next((i for i, (a, b) in enumerate(zip(have, wanted)) if a != b), None)
    if differ is not None:  # the samples made there answer other prompts
        raise ValueError(f"{path} holds other prompts than prompt_file={config.prompt_file!r} (prompt "
                         f"{differ + 1}: {have[differ][:40]!r}, not {wanted[differ][:40]!r}): its samples "
                         "answer those; give another --out for these prompts")
    return wanted


def make_prompts(llm, config: DataConfig, out_dir: str, progress=None) -> list[str]:
    """``prompts.jsonl`` in ``out_dir``, completed to ``config.num_prompts`` prompts (resumed when it exists)."""
    from specray.sampling_params import SamplingParams

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PROMPTS_FILE)
    have = kept_prompts(config, out_dir)
    if config.prompt_file is not None:
        wanted = file_prompts(config, out_dir)
        if len(have) < len(wanted):
            _append(path, [{"prompt": p} for p in wanted[len(have):]])
        return wanted
    tokenizer = llm.get_tokenizer()
    prefix = tokenizer.encode(user_turn_prefix(tokenizer), add_special_tokens=False)
    seen = set(have)
    tries, attempt, last_len = 0, 0, -1
    while len(have) < config.num_prompts:
        tries += 1
        if tries > 20 and len(have) < tries:  # fewer than one usable prompt per round: it will not get there
            raise ValueError(f"the target wrote only {len(have)} usable prompts in {tries} rounds of "
                             f"{config.batch_size} (each must end within prompt_max_tokens="
                             f"{config.prompt_max_tokens} and be new); give prompts with --prompt-file")
        n = min(config.batch_size, config.num_prompts - len(have))
        attempt = attempt + 1 if len(have) == last_len else 0
        last_len = len(have)
        # a seed per (prompts kept so far, attempt at that count, i): a resumed run draws new samples, never the
        # ones an earlier run drew and kept
        params = [SamplingParams(temperature=config.prompt_temperature, top_p=config.prompt_top_p,
                                 max_tokens=config.prompt_max_tokens, seed=_seed(config.seed, len(have), attempt, i))
                  for i in range(n)]
        outs = llm.generate([{"prompt_token_ids": prefix}] * n, params, use_tqdm=False)
        fresh = []
        for out in outs:
            c = out.outputs[0]
            text = c.text.strip()
            # a prompt cut by max_tokens is half a question; an empty or repeated one teaches nothing
            if c.finish_reason == "stop" and len(text) >= 8 and text not in seen:
                seen.add(text)
                fresh.append(text)
        fresh = fresh[: config.num_prompts - len(have)]
        _append(path, [{"prompt": p} for p in fresh])
        have += fresh
        if progress is not None:
            progress(len(have), config.num_prompts)
    return have


def _seed(*parts: int) -> int:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_samples(llm, prompts: list[str], config: DataConfig, out_dir: str, progress=None) -> list[dict[str, Any]]:
    """``samples.jsonl`` in ``out_dir``: every prompt answered greedily (resumed when it exists). A record is
    ``{"prompt": i, "token_ids": [...], "num_prompt_tokens": n}``: the whole sequence the target saw and wrote."""
    from specray.sampling_params import SamplingParams

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, SAMPLES_FILE)
    done = read_jsonl(path)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=config.answer_max_tokens)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts[len(done):]]
    limit = llm.engine.max_model_len
    for i, text in enumerate(texts, len(done)):  # all checked before any is answered
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n >= limit:
            where = f"prompt_file={config.prompt_file!r}" if config.prompt_file else "the prompts"
            raise ValueError(f"prompt {i + 1} of {where} ({prompts[i][:40]!r}...) is {n} tokens in the chat "
                             f"template, and the target's max_model_len={limit} leaves no room for an answer: "
                             "shorten it or leave it out")
    for start in range(len(done), len(prompts), config.batch_size):
        batch = texts[start - len(done) : start - len(done) + config.batch_size]
        outs = llm.generate([{"prompt": t, "add_special_tokens": False} for t in batch], params, use_tqdm=False)
        records = [{"prompt": start + i, "token_ids": list(o.prompt_token_ids) + list(o.outputs[0].token_ids),
                    "num_prompt_tokens": len(o.prompt_token_ids)} for i, o in enumerate(outs)]
        _append(path, records)
        done += records
        if progress is not None:
            progress(len(done), len(prompts))
    return done
