"""Drive an OpenAI-compatible server with streaming completions and measure latency.

TTFT: request sent -> first streamed token. ITL: gaps between streamed chunks.
TPOT: (last token - first token) / (output tokens - 1), per request. Peak KV usage is
polled from the server's /metrics (dcpjax:kv_cache_usage_perc) while the run lasts.
Each stream ends with its usage (`stream_options.include_usage`), whose
`prompt_tokens_details.cached_tokens` gives the prefix cache hit rate (cached prompt
tokens / prompt tokens, as vLLM counts it) and splits TTFT into hits and misses.

Datasets: "random" (prompts of --random-input-len tokens, nothing shared) and
"prefix_repetition" (vLLM's: --prefix-repetition-num-prefixes prefixes of
--prefix-repetition-prefix-len tokens, each prompt one of them plus its own
--prefix-repetition-suffix-len tokens; request i takes prefix i mod P, a round robin, which
is least-recently-used eviction's worst case when the prefixes do not all fit in the cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import time

import httpx
import numpy as np
from tqdm.auto import tqdm


@dataclasses.dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


# 32 words, so that two random prompts rarely share a first cache block (32 tokens: about once in
# 10^7 pairs; with 8 words once in 10^4, and a warm-up of 32 prompts often warmed a measured one)
WORDS = ["context", "parallel", "decode", "cache", "token", "device", "latent", "shard", "prefill", "block",
         "attention", "query", "key", "value", "softmax", "kernel", "mesh", "rank", "chunk", "batch",
         "scheduler", "request", "stream", "sample", "layer", "head", "vector", "page", "table", "slot",
         "budget", "window"]


def _text(rng: random.Random, length: int) -> str:
    """Random words, `length` characters (tokens, for a byte-level tokenizer)."""
    text = ""
    while len(text) < length:
        text += rng.choice(WORDS) + " "
    return text[:length]


def make_prompts(num: int, input_len: int, seed: int | str = 0) -> list[str]:
    """Prompts of about input_len tokens for a byte-level tokenizer (one character a token)."""
    rng = random.Random(seed)
    return [_text(rng, input_len) for _ in range(num)]


def make_prefix_repetition_prompts(num: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                                   seed: int | str = 0) -> list[str]:
    """`num` prompts: prefix i mod `num_prefixes` (of `prefix_len` tokens) + a suffix of its own."""
    if min(num, prefix_len, suffix_len, num_prefixes) < 1:
        raise ValueError("--num-prompts, --prefix-len, --suffix-len and --num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_text(rng, prefix_len) for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + _text(rng, suffix_len) for i in range(num)]


async def one_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, output_len: int,
                      headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            finish = None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                if choice.get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                finish = choice.get("finish_reason") or finish
        result.latency = time.perf_counter() - start
        result.output_tokens = output_len if finish == "length" else len(result.itl) + 1
        result.ok = finish is not None
        if not result.ok:
            result.error = "stream ended without a finish_reason"
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
    return result


async def _poll_kv_usage(client: httpx.AsyncClient, base_url: str, peak: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            text = (await client.get(f"{base_url}/metrics")).text
            match = re.search(r"^dcpjax:kv_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", text, re.MULTILINE)
            if match:
                peak[0] = max(peak[0], float(match.group(1)))
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.02)  # short runs last a fraction of a second
        except TimeoutError:
            pass


def _stats(values) -> dict:
    values = np.asarray(values, float) * 1e3
    if values.size == 0:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    return {"mean_ms": float(values.mean()), "median_ms": float(np.median(values)),
            "p99_ms": float(np.percentile(values, 99))}


async def run_benchmark(base_url: str, model: str, *, prompts: list[str], output_len: int | list[int],
                        max_concurrency: int, request_rate: float = float("inf"), api_key: str | None = None,
                        progress: bool = True, seed: int = 0, desc: str = "requests") -> dict:
    """Send `prompts` (at most `max_concurrency` at once, at `request_rate`) and measure.

    `output_len`: tokens each request generates, or one count per prompt."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    num_prompts = len(prompts)
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        semaphore = asyncio.Semaphore(max_concurrency)
        peak, stop = [0.0], asyncio.Event()
        poller = asyncio.create_task(_poll_kv_usage(client, base_url, peak, stop))
        bar = tqdm(total=num_prompts, desc=desc, disable=not progress)
        rng = np.random.default_rng(seed)

        async def limited(prompt, max_tokens):
            async with semaphore:
                r = await one_request(client, base_url, model, prompt, max_tokens, headers)
            bar.update()
            return r

        start = time.perf_counter()
        tasks = []
        lengths = output_len if isinstance(output_len, list) else [output_len] * num_prompts
        for prompt, max_tokens in zip(prompts, lengths, strict=True):
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))  # Poisson arrivals
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        stop.set()
        await poller
        bar.close()
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "num_prompts": num_prompts, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "output_len": output_len, "max_concurrency": max_concurrency,
        "request_rate": request_rate if request_rate != float("inf") else "inf",
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "ttft": _stats([r.ttft for r in ok]),
        "tpot": _stats(tpot),
        "itl": _stats([gap for r in ok for gap in r.itl]),
        "peak_kv_cache_usage": peak[0],
        "prompt_tokens": prompt_tokens,
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_hit": _stats([r.ttft for r in ok if r.cached_tokens > 0]),  # some of the prompt was cached
        "ttft_miss": _stats([r.ttft for r in ok if r.cached_tokens == 0]),
    }
