"""The offline API, shaped like vLLM's: ``LLM(model=..., speculative_config=...).generate(prompts, params)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from specray.config import EngineArgs
from specray.engine import LLMEngine
from specray.outputs import RequestOutput, SpecStats
from specray.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


class LLM:
    """An engine in this process. Keyword arguments are those of :class:`specray.config.EngineArgs`."""

    def __init__(self, model: str, **kwargs: Any):
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine = LLMEngine.from_engine_args(self.engine_args)

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def spec_stats(self) -> SpecStats:
        """Speculation counters over everything this LLM generated."""
        return self.engine.spec_stats

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. Prompts are strings, token-id
        prompts ``{"prompt_token_ids": [...]}``, or ``{"prompt": "..."}``. All prompts are validated before any
        runs, so a bad one raises ValueError and nothing else is disturbed."""
        prompts = _as_list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for (text, ids), sp in zip(encoded, params):
            self._validate(ids, sp)
        req_ids = []
        try:
            for (text, ids), sp in zip(encoded, params):
                req_ids.append(self.engine.add_request(ids, _copy(sp), prompt=text))
        except ValueError:
            self.engine.abort_request(req_ids)
            raise
        return self._run(req_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or to several."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; pass chat_template=... or use generate()")
        prompts = [
            tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template)
            for conv in conversations
        ]
        return self.generate([{"prompt": p, "add_special_tokens": False} for p in prompts], sampling_params,
                             use_tqdm)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.get_tokenizer().encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            text = prompt["prompt"]
            return text, self.get_tokenizer().encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
        raise ValueError(f"prompt {prompt!r:.80} is not a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}")

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        self.engine._check_tokens(ids)
        limit = self.engine.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len={limit} leaves no room to generate; "
                             f"shorten the prompt to at most {limit - 1} tokens or raise max_model_len")

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(req_ids)
        final: dict[str, RequestOutput] = {}
        bar = _progress(len(req_ids)) if use_tqdm else None
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    final[out.request_id] = out
                    pending.discard(out.request_id)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in req_ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [{"prompt_token_ids": prompts}]
    return prompts


def _params_per_prompt(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    sampling_params = list(sampling_params)
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return sampling_params


def _copy(params: SamplingParams) -> SamplingParams:
    from dataclasses import replace

    return replace(params)


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Generating", unit="req")
