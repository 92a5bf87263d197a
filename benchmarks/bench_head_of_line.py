"""A short request sent while a long prompt is being prefilled: how long it waits for its first token.

A running server (``specray serve``) gets one chat request with a long prompt (``--long-words`` words, a few
generated tokens); ``--delay`` seconds later, a short streaming chat request. Printed: the short request's time to
first token and total time, and the long request's total time. Run it against a server started with and without
``--engine-kwargs long_prefill_token_threshold=N`` to see what bounding a prompt's prefill per step buys:

    specray serve --port 8011 [--engine-kwargs long_prefill_token_threshold=256]
    PYTHONSAFEPATH=1 python benchmarks/bench_head_of_line.py --base-url http://127.0.0.1:8011 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import time

import aiohttp


async def long_request(session: aiohttp.ClientSession, url: str, model: str, words: int) -> float:
    start = time.perf_counter()
    body = {"model": model, "messages": [{"role": "user", "content": "hello world " * (words // 2)}],
            "max_tokens": 4}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
    return time.perf_counter() - start


async def short_request(session: aiohttp.ClientSession, url: str, model: str) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


async def one_round(base: str, model: str, words: int, delay: float) -> dict:
    url = base + "/v1/chat/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        long_task = asyncio.create_task(long_request(session, url, model, words))
        await asyncio.sleep(delay)
        ttft, total = await short_request(session, url, model)
        return {"short_ttft_s": round(ttft, 2), "short_total_s": round(total, 2),
                "long_total_s": round(await long_task, 2)}


async def served_model(base: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(base + "/v1/models") as resp:
            return (await resp.json())["data"][0]["id"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--long-words", type=int, default=6000, help="words in the long prompt (about a token each)")
    p.add_argument("--delay", type=float, default=3.0, help="seconds between the long and the short request")
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()
    for flag, least in (("long_words", 1), ("delay", 0), ("rounds", 1)):
        if getattr(args, flag) < least:
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(args, flag)}")
    base = args.base_url.rstrip("/").removesuffix("/v1")
    try:
        model = asyncio.run(served_model(base))
    except (aiohttp.ClientError, ValueError, KeyError, IndexError) as err:
        p.error(f"no OpenAI server answers /v1/models at {base} ({type(err).__name__}: {err}); start one (specray serve) or "
                "give its --base-url")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    print(f"# {platform.machine()}, {when} UTC, commit {commit}, {base}, model {model}, "
          f"long prompt of {args.long_words} words, short request {args.delay} s later")
    for _ in range(args.rounds):
        print(json.dumps(asyncio.run(one_round(base, model, args.long_words, args.delay))))


if __name__ == "__main__":
    main()
