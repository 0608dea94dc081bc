"""bench/routing.py's workloads and their replay over gRPC: who sends what, when, and what each
response measured.

A workload is a list of prompts (token ids) and a way to send them:
- open loop (`arrivals`: a send time for each prompt): Poisson, or bursts of many at once;
- closed loop (`clients`: that many clients, each sending its next prompt when the last one has
  finished): saturation, the load a serving cluster is sized for.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import statistics
import time
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    arrivals: list[float] | None = None  # open loop: send times (s from the start)
    clients: int = 0  # closed loop: concurrent clients
    about: str = ""


def kjv_verses() -> list[str]:
    spec = importlib.util.find_spec("bible")
    path = os.path.join(spec.submodule_search_locations[0], "data", "kjv.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def _system_prompt(rng, verses, tokenizer, label: str, num_tokens: int) -> list[int]:
    start = rng.randrange(len(verses) - 400)
    text = f"You are the assistant of {label}. Answer from this text.\n" + " ".join(
        verses[start:start + 200])
    ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
    assert len(ids) == num_tokens, "a system prompt came out short"
    return ids


def _question(rng, verses, tokenizer) -> list[int]:
    return tokenizer.encode("\nQuestion: " + rng.choice(verses), add_special_tokens=False)[:48]


def tenant_prompts(args, tokenizer, n: int, seed: int) -> list[list[int]]:
    """n multi-tenant prompts: one of `args.tenants` system prompts (`args.system_tokens`
    tokens each) + a question (one KJV verse, 8-48 tokens), tenants interleaved at random."""
    rng, verses = random.Random(args.seed), kjv_verses()
    systems = [_system_prompt(rng, verses, tokenizer, f"tenant {t}", args.system_tokens)
               for t in range(args.tenants)]
    rng = random.Random(seed)
    return [systems[rng.randrange(args.tenants)] + _question(rng, verses, tokenizer)
            for _ in range(n)]


def unrelated_prompts(args, tokenizer, n: int, seed: int) -> list[list[int]]:
    """n prompts of the same lengths as the tenants' that share nothing: each its own system
    prompt."""
    rng, verses = random.Random(seed), kjv_verses()
    return [_system_prompt(rng, verses, tokenizer, f"caller {i}", args.system_tokens)
            + _question(rng, verses, tokenizer) for i in range(n)]


def workloads(args, tokenizer) -> list[Workload]:
    """The benchmark's workloads, by `args.workloads`."""
    out = []
    for name in args.workloads:
        if name == "poisson":
            rng, now, arrivals = random.Random(args.seed), 0.0, []
            for _ in range(args.requests):
                now += rng.expovariate(args.rate)
                arrivals.append(now)
            out.append(Workload(name, tenant_prompts(args, tokenizer, args.requests, 1),
                                arrivals, about=f"multi-tenant, Poisson at {args.rate} req/s"))
        elif name == "bursts":
            n = args.burst_size * args.bursts
            arrivals = [b * args.burst_every_s for b in range(args.bursts)
                        for _ in range(args.burst_size)]
            out.append(Workload(name, tenant_prompts(args, tokenizer, n, 2), arrivals,
                                about=f"multi-tenant, {args.bursts} bursts of "
                                      f"{args.burst_size} every {args.burst_every_s} s"))
        elif name == "closed":
            out.append(Workload(name, tenant_prompts(args, tokenizer, args.closed_requests, 3),
                                clients=args.clients_per_worker * args.workers,
                                about=f"multi-tenant, closed loop of "
                                      f"{args.clients_per_worker * args.workers} clients"))
        elif name == "closed_unrelated":
            out.append(Workload(name, unrelated_prompts(args, tokenizer, args.closed_requests, 4),
                                clients=args.clients_per_worker * args.workers,
                                about=f"unrelated prompts, closed loop of "
                                      f"{args.clients_per_worker * args.workers} clients"))
        else:
            raise ValueError(f"unknown workload {name!r}")
    return out


async def replay(port: int, app: str, workload: Workload, max_tokens: int) -> list[dict]:
    """Send the workload's prompts; one record per request: send time, TTFT, end-to-end
    latency, output tokens, prompt and cached tokens (the response's usage)."""
    import grpc

    from mxserve.cluster.client import build_request
    from mxserve.proto import mxserve_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(f"localhost:{port}") for _ in range(8)]
    stubs = [pb_grpc.MxServeStub(c) for c in channels]
    metadata = (("application", app),)

    async def one(i: int, prompt: list[int]) -> dict:
        request = build_request(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True)
        sent = time.perf_counter()
        first = last = usage = None
        num_tokens = 0
        async for r in stubs[i % len(stubs)].Generate(request, metadata=metadata):
            last = time.perf_counter()
            first = first or last
            num_tokens += len(r.token_ids)
            if r.finish_reason:
                usage = r.usage
        return dict(sent=sent, ttft=first - sent, e2e=last - sent, end=last,
                    tokens=num_tokens, prompt=usage.prompt_tokens, cached=usage.cached_tokens)

    async def at(i: int, arrival: float, prompt: list[int], t0: float) -> dict:
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        return await one(i, prompt)

    async def client(c: int, queue: list[tuple[int, list[int]]], out: list[dict]) -> None:
        while queue:
            i, prompt = queue.pop(0)
            out.append(await one(i, prompt))

    try:
        if workload.arrivals is not None:
            t0 = time.perf_counter()
            return list(await asyncio.gather(*(at(i, a, p, t0) for i, (a, p) in
                                               enumerate(zip(workload.arrivals,
                                                             workload.prompts)))))
        queue, out = list(enumerate(workload.prompts)), []
        await asyncio.gather(*(client(c, queue, out) for c in range(workload.clients)))
        return out
    finally:
        for c in channels:
            await c.close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results: list[dict]) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    e2e = [r["e2e"] * 1e3 for r in results]
    span = max(r["end"] for r in results) - min(r["sent"] for r in results)
    return dict(num_requests=len(results),
                hit_rate=round(sum(r["cached"] for r in results)
                               / sum(r["prompt"] for r in results), 4),
                ttft_ms=dict(p50=round(pct(ttft, .5), 1), p99=round(pct(ttft, .99), 1),
                             mean=round(statistics.fmean(ttft), 1)),
                e2e_ms=dict(p50=round(pct(e2e, .5), 1), p99=round(pct(e2e, .99), 1)),
                requests_per_s=round(len(results) / span, 3),
                output_tok_s=round(sum(r["tokens"] for r in results) / span, 1))
