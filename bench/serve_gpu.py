"""The served path on the GPU: gRPC -> Ray Serve proxy -> router -> one GPU worker replica, vs
the same engine in-process, in the same run, on the same requests.

Model: a dummy-weight Llama shape (`--shape`, worker/model/dummy.py) in a directory with its
config.json and a word-level tokenizer.json ("w<id>" per id, so the router can detokenize);
prompts go as token ids. Two loads:
- mix: bench/engine_gpu.py's 512 requests (ShareGPT-like lengths) all at t=0, greedy, exact
  output lengths (ignore_eos); served, they are sent by `--clients` processes (grpc.aio, the
  requests dealt round-robin) so the clients are not the limit; in-process, by one asyncio loop
  over `AsyncEngine.generate` (the engine thread steps while the loop streams);
- batch 1: `--b1-requests` requests one after another (256-token prompt, 128 tokens): TTFT and
  TPOT; served, from one client process on one channel, after one unmeasured request (a
  process and channel a request paid a fresh channel's first call in every TTFT).
The in-process engine runs first and stays (the rounds step it again) beside Serve's worker on the
same GPU.

Targets (issue 31): served output tok/s on the mix >= 90% of in-process (the engine stepped in a
loop: the median over `--rounds` mixes, each run in a loop and then served side by side, since
lent hosts drift); batch 1: served TPOT <= in-process TPOT + 0.2 ms, served TTFT <= in-process
TTFT + 10 ms. The in-process engine stays on the GPU beside the served worker (two KV pools of
--kv-gb).

    python bench/serve_gpu.py --out bench/results/serve_gpu.json        # on the H200
    python bench/serve_gpu.py --variants serve,direct --out ...         # both output paths
    python bench/serve_gpu.py --routers 2 --variants ingress_intake,ingress_direct --out ...
      (the default served path, and the same with a Serve call a request)
    python bench/serve_gpu.py --shape tiny --num-requests 32 --kv-gb 1 --out /tmp/s.json
      (a CPU smoke: there both KV pools are host memory, so keep --kv-gb small)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from engine_gpu_mix import make_mix, run_mix  # noqa: E402
from revision import head_commit, write_result  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
            bos_token_id=1, eos_token_id=2, hidden_act="silu", tie_word_embeddings=True)


def model_dir(shape: str, max_len: int) -> str:
    """A directory the router can open (config + tokenizer) and the worker loads as dummy."""
    from mxserve.worker.model.dummy import DUMMY_MODELS

    config = dict(TINY if shape == "tiny" else DUMMY_MODELS[shape])
    config["max_position_embeddings"] = max(max_len, config["max_position_embeddings"])
    path = Path(tempfile.mkdtemp()) / shape
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    vocab = {f"w{i}": i for i in range(config["vocab_size"])}
    tokenizer = {"version": "1.0", "added_tokens": [], "normalizer": None,
                 "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
                 "decoder": None,
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    sparse_safetensors(config, path / "model.safetensors")
    return str(path)


def sparse_safetensors(config: dict, path: Path) -> None:
    """A safetensors file listing every tensor of `config` whose data is a hole: the router
    opens the checkpoint for its config and tokenizer and checks the tensors are listed, but
    reads none (the worker draws its weights: load_format dummy)."""
    from mxserve.worker.model import dummy

    cfg = dummy.hf_model_config(config, {}, "serve-gpu")
    header, offset = {}, 0
    for name in dummy.expected_tensor_names(cfg):
        shape = dummy.tensor_shape(cfg, name)
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset,
                                                                               offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def engine_options(args) -> dict:
    """bench/engine_gpu.py's mix configuration."""
    return dict(load_format="dummy", dtype="bfloat16" if args.shape != "tiny" else "float32",
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_batched_tokens, kv_cache_memory_gb=args.kv_gb,
                load_progress=False)


def summarize(records: list[dict], wall_s: float) -> dict:
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    tokens = sum(r["tokens"] for r in records)
    ttft = [r["ttft_ms"] for r in records]
    tpot = [r["tpot_ms"] for r in records if r["tokens"] > 1]
    return {"requests": len(records), "output_tokens": tokens, "wall_s": round(wall_s, 3),
            "output_tok_s": round(tokens / wall_s, 1),
            "messages_per_request": round(sum(r["messages"] for r in records) / len(records), 1),
            "ttft_ms": {"p50": pct(ttft, .5), "p99": pct(ttft, .99)},
            "tpot_ms": {"mean": round(sum(tpot) / max(1, len(tpot)), 3), "p50": pct(tpot, .5),
                        "p99": pct(tpot, .99)}}


def record(start: float, times: list[float], tokens: int, messages: int) -> dict:
    return {"tokens": tokens, "messages": messages, "ttft_ms": (times[0] - start) * 1e3,
            "tpot_ms": (times[-1] - times[0]) * 1e3 / max(1, tokens - 1), "start": start,
            "end": times[-1]}


def ray_process_cpu() -> dict[str, float]:
    """CPU seconds (user + system) so far of each Ray process on this host, by its title
    ("ray::ServeReplica:mxserve:Router", "ray::ProxyActor", ...; several of one title summed;
    without the method an actor runs now, which Ray appends: ".record_routing_stats"), read
    from /proc (Linux)."""
    from mxserve.cluster.logs import stat_cpu_s

    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().split(b"\0")[0].decode(errors="replace").split(".")[0]
        except OSError:
            continue
        stat = stat_cpu_s(f"/proc/{pid}/stat") if title.startswith("ray::") else None
        if stat is not None:
            out[title] = out.get(title, 0.0) + stat[1]
    return out


def loop_delta(before: dict, after: dict) -> dict:
    """The engine loop thread over a run (AsyncEngine.loop_stats): steps, and a step's wall
    and CPU time in ms. Wall well over CPU (beyond the device's share) is waiting for the GIL."""
    steps = after["num_steps"] - before["num_steps"]
    wall = after["step_wall_s"] - before["step_wall_s"]
    cpu = after["step_cpu_s"] - before["step_cpu_s"]
    out = {"num_steps": steps, "step_wall_ms": round(1e3 * wall / max(1, steps), 3),
           "step_cpu_ms": round(1e3 * cpu / max(1, steps), 3), "wall_s": round(wall, 3),
           "cpu_s": round(cpu, 3)}
    for part in ("wall", "cpu"):  # of which the hand-over of outputs (AsyncEngine._deliver_all)
        spent = after[f"deliver_{part}_s"] - before[f"deliver_{part}_s"]
        out[f"deliver_{part}_ms"] = round(1e3 * spent / max(1, steps), 3)
    return out


def sequential(records: list[dict]) -> dict:
    """Requests sent one after another: the wall time is the sum of theirs."""
    return summarize(records, sum(r["end"] - r["start"] for r in records))


# ---- in-process ------------------------------------------------------------------------------
def engine_loop(raw, mix, warm=None) -> dict:
    """The mix with engine.step() in a loop (no streaming at all), after a warm-up as
    engine_gpu's where `warm` is given: prefill chunks of every size compile their kernels
    there, not in the measured loop (an 8-request warm-up left the loop's rate anywhere in
    18-31k tok/s). The prefix cache is reset after, so what runs next starts as cold."""
    if warm is not None:
        run_mix(SimpleNamespace(engine=raw), *warm)
        raw.kv.reset_prefix_cache()
    cpu = time.thread_time()
    out = run_mix(SimpleNamespace(engine=raw), *mix)
    out["cpu_s"] = time.thread_time() - cpu
    raw.kv.reset_prefix_cache()
    return {k: out[k] for k in ("output_tok_s", "wall_s", "num_steps", "ttft_ms_p50",
                                "tpot_ms_p50", "cpu_s")}


def run_inproc(raw, mix, b1, warm) -> dict:
    """The engine loop on the mix, then the same engine streamed in-process (AsyncEngine):
    the mix, then batch 1. The engine stays (the served runs' rounds step it again)."""
    from mxserve.api.sampling_params import SamplingParams
    from mxserve.worker.async_engine import AsyncEngine

    engine_mix = engine_loop(raw, mix, warm)
    engine = AsyncEngine(raw)
    engine.start()

    async def one(prompt: list[int], num_tokens: int) -> dict:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
        start, times, tokens, messages = time.perf_counter(), [], 0, 0
        async for out in engine.generate(prompt, params):
            messages += 1
            if out.new_token_ids:
                times.append(time.perf_counter())
                tokens += len(out.new_token_ids)
        return record(start, times, tokens, messages)

    async def main() -> dict:
        await asyncio.gather(*(one(p, 8) for p in mix[0][:8]))  # warm-up
        before, start = engine.loop_stats(), time.perf_counter()
        records = await asyncio.gather(*(one(p, k) for p, k in zip(*mix)))
        out = {"engine_mix": engine_mix, "mix": summarize(records, time.perf_counter() - start)}
        out["mix"]["engine_loop"] = loop_delta(before, engine.loop_stats())
        b1_records = [await one(p, k) for p, k in zip(*b1)]
        out["batch1"] = sequential(b1_records)
        return out

    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()  # (the loop thread only: the engine steps on)


# ---- served ----------------------------------------------------------------------------------
def client_process(port: int, app: str, jobs: list, barrier, results,
                   sequential: bool = False, channels: int = 1) -> None:
    """One load-generating process: its requests all at once once every client is ready,
    dealt over `channels` channels of their own connection each (grpc otherwise shares one
    between a process's channels; the routers' own port spreads connections, not calls), or
    (sequential) one after another on one channel, after one unmeasured request: what one
    client sending one request at a time sees."""
    import grpc

    from mxserve.proto import mxserve_pb2 as pb
    from mxserve.proto import mxserve_pb2_grpc as pb_grpc

    async def main() -> list[dict]:
        opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.use_local_subchannel_pool", 1)]) for _ in range(channels)]
        stubs = [pb_grpc.MxServeStub(c) for c in opened]
        metadata = (("application", app),)

        async def one(prompt: list[int], num_tokens: int, stub=stubs[0]) -> dict:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                         sampling_params=pb.SamplingParams(
                                             max_tokens=num_tokens, temperature=0,
                                             ignore_eos=True))
            start, times, tokens, messages = time.perf_counter(), [], 0, 0
            async for r in stub.Generate(request, metadata=metadata):
                messages += 1
                if r.token_ids:
                    times.append(time.perf_counter())
                    tokens += len(r.token_ids)
            return record(start, times, tokens, messages)

        for channel in opened:
            await channel.channel_ready()
        await asyncio.to_thread(barrier.wait)
        if sequential:
            await one(*jobs[0])  # the channel's first call: not measured
            got = [await one(p, k) for p, k in jobs]
        else:
            got = await asyncio.gather(*(one(p, k, stubs[i % channels])
                                         for i, (p, k) in enumerate(jobs)))
        for channel in opened:
            await channel.close()
        return got

    results.put(asyncio.run(main()))


def run_served(args, model: str, mix, b1, warm, direct: bool = False,
               ingress: bool = False, intake: bool = False, raw=None,
               rounds: list | None = None) -> dict:
    """ingress: the routers answer grpc_port themselves (ServeConfig.ingress "routers"), else
    Serve's gRPC proxy does ("proxy"). intake: requests reach the worker over the routers'
    intake connections (ServeConfig.streaming.intake), not as Serve calls. rounds: mixes each
    run by the in-process engine `raw` in a loop, then served, one after the other: a host
    whose speed drifts (some lent machines' loop read 20k and 28k tok/s minutes apart) moves
    both sides of a round alike."""
    import ray
    from ray import serve

    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.deployments import WORKER
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import free_fixed_port

    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    gpu = args.shape != "tiny"
    config = ServeConfig(model=model, engine=engine_options(args), routing=dict(
        policy="prefix" if intake else "round_robin"), grpc_port=free_fixed_port(),
        http_port=free_fixed_port(),
        max_queued_requests=args.num_requests, proxy_location="HeadOnly",
        worker_resources=Resources(num_cpus=2, num_gpus=1 if gpu else 0),
        router_resources=Resources(num_cpus=1), num_routers=args.routers,
        streaming=dict(streams_per_token=args.streams_per_token,
                       max_tokens_per_message=args.max_tokens_per_message, direct=direct,
                       intake=intake),
        ingress="routers" if ingress else "proxy")
    ray.init(num_cpus=max(4, os.cpu_count() or 4), num_gpus=1 if gpu else 0,
             include_dashboard=False, object_store_memory=2 << 30, log_to_driver=False)
    try:
        deploy(config)
        wait_for_grpc(config)
        load(config, list(zip(*warm)), args.clients, raw=True)  # the in-process warm-up
        worker = serve.get_deployment_handle(WORKER, config.app_name)
        before, cpu_before = worker.audit.remote().result(), ray_process_cpu()
        spy = start_py_spy(args.py_spy, before["pid"], args.out, ingress, direct)
        out = {"mix": load(config, list(zip(*mix)), args.clients)}
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile when interrupted
            spy.wait(timeout=60)
        after, cpu_after = worker.audit.remote().result(), ray_process_cpu()
        out["mix"]["process_cpu_s"] = {  # the served path's processes over the mix
            title: round(cpu_after[title] - cpu_before.get(title, 0.0), 2)
            for title in sorted(cpu_after) if cpu_after[title] - cpu_before.get(title, 0.0) > 0.05}
        out["mix"]["engine_loop"] = loop_delta(before["engine_loop"], after["engine_loop"])
        out["mix"]["worker_process_cpu_s"] = round(
            after["process_cpu_s"] - before["process_cpu_s"], 3)
        threads = {name: cpu - before["thread_cpu_s"].get(name, 0.0)
                   for name, cpu in after["thread_cpu_s"].items()}
        out["mix"]["worker_thread_cpu_s"] = {  # which threads share the worker's GIL
            name: round(cpu, 2) for name, cpu in sorted(threads.items(), key=lambda kv: -kv[1])
            if cpu > 0.02}
        # one client, one request at a time
        out["batch1"] = sequential(load(config, list(zip(*b1)), 1, raw=True, one_by_one=True))
        out["rounds"] = []
        for round_mix in rounds or []:
            loop = engine_loop(raw, round_mix)["output_tok_s"]
            served = load(config, list(zip(*round_mix)), args.clients)["output_tok_s"]
            out["rounds"].append({"engine_loop_tok_s": round(loop, 1),
                                  "served_tok_s": round(served, 1),
                                  "served_over_loop": round(served / loop, 4)})
        return out
    finally:
        serve.shutdown()
        ray.shutdown()


def start_py_spy(py_spy: str | None, pid: int, out: str, ingress: bool, direct: bool):
    """`py-spy record` of the worker process over the mix (--py-spy: its binary): samples
    only while a thread holds the GIL, by thread, in py-spy's raw (collapsed stacks) format
    next to --out. None without --py-spy."""
    if not py_spy:
        return None
    name = "served" + ("_ingress" if ingress else "") + ("_direct" if direct else "")
    path = os.path.splitext(out)[0] + f".{name}.worker.py-spy.txt"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return subprocess.Popen([py_spy, "record", "--pid", str(pid), "--gil", "--threads",
                             "--rate", "100", "--format", "raw", "--output", path])


def load(config, jobs: list, num_clients: int, raw: bool = False, one_by_one: bool = False):
    """`jobs` (prompt, tokens) dealt round-robin over num_clients processes, all at once
    (one_by_one: each process sends its share one after another); to the routers 4
    connections a process (the kernel spreads connections over them), to Serve's proxy one."""
    ctx = mp.get_context("spawn")
    num_clients = min(num_clients, len(jobs))
    barrier, results = ctx.Barrier(num_clients), ctx.Queue()
    channels = 4 if config.ingress == "routers" else 1
    procs = [ctx.Process(target=client_process, args=(
        config.grpc_port, config.app_name, jobs[i::num_clients], barrier, results, one_by_one,
        1 if one_by_one else channels)) for i in range(num_clients)]
    for p in procs:
        p.start()
    records = [r for _ in procs for r in results.get(timeout=1800)]
    for p in procs:
        p.join()
    if raw:
        return records
    start = min(r["start"] for r in records)
    return summarize(records, max(r["end"] for r in records) - start)


# ---- report ----------------------------------------------------------------------------------
def mix_ratio(inproc: dict, served: dict) -> float:
    """Served over the engine stepped in a loop (no streaming at all: the stricter reading of
    "the in-process engine") on the mix: the median over the rounds, each side by side, where
    there were rounds; else the first mix's (the loop ran minutes before)."""
    ratios = [r["served_over_loop"] for r in served.get("rounds", [])]
    if not ratios:
        return served["mix"]["output_tok_s"] / inproc["engine_mix"]["output_tok_s"]
    return statistics.median(ratios)


def targets(inproc: dict, served: dict) -> dict:
    return {"mix_tok_s_ge_90pct_of_engine": mix_ratio(inproc, served) >= 0.9,
            "b1_tpot_le_engine_plus_0.2ms": served["batch1"]["tpot_ms"]["mean"]
            <= inproc["batch1"]["tpot_ms"]["mean"] + 0.2,
            "b1_ttft_le_inproc_plus_10ms": served["batch1"]["ttft_ms"]["p50"]
            <= inproc["batch1"]["ttft_ms"]["p50"] + 10}


def markdown(result: dict) -> str:
    rows = ["| load | path | output tok/s | TTFT p50 / p99 ms | TPOT mean / p50 / p99 ms | "
            "messages a request |", "|---|---|---|---|---|---|"]
    paths = ["inproc", *result.get("served_variants", {"served": None})]
    for load_name in ("mix", "batch1"):
        for path in paths:
            r = result[path][load_name]
            rows.append(f"| {load_name} | {path} | {r['output_tok_s']:.0f} | "
                        f"{r['ttft_ms']['p50']} / {r['ttft_ms']['p99']} | "
                        f"{r['tpot_ms']['mean']} / {r['tpot_ms']['p50']} / "
                        f"{r['tpot_ms']['p99']} | {r['messages_per_request']} |")
    mix = {"engine": result["inproc"]["engine_mix"]["output_tok_s"],
           "stream": result["inproc"]["mix"]["output_tok_s"]}
    em = result["inproc"]["engine_mix"]
    loops = [("engine loop", em["num_steps"], 1e3 * em["wall_s"] / em["num_steps"],
              1e3 * em["cpu_s"] / em["num_steps"], "", None)]
    for path in paths:
        lp = result[path]["mix"]["engine_loop"]
        loops.append((f"{path} streams", lp["num_steps"], lp["step_wall_ms"], lp["step_cpu_ms"],
                      f"{lp.get('deliver_wall_ms', '')} / {lp.get('deliver_cpu_ms', '')}",
                      result[path]["mix"].get("worker_process_cpu_s")))
    loop_rows = ["| mix | engine steps | step wall ms | engine thread CPU ms a step | of which "
                 "hand-over wall / CPU ms | worker process CPU s |",
                 "|---|---|---|---|---|---|"] + [
        f"| {name} | {n} | {wall:.3f} | {cpu:.3f} | {deliver} | {'' if proc is None else proc} |"
        for name, n, wall, cpu, deliver, proc in loops]
    cpu_rows = ["| path | process | CPU s over the mix | cores |", "|---|---|---|---|"]
    for path in paths[1:]:
        served_mix = result[path]["mix"]
        cpu_rows += [f"| {path} | {title} | {s} | {s / served_mix['wall_s']:.2f} |"
                     for title, s in served_mix.get("process_cpu_s", {}).items()]
    thread_rows = ["| path | worker thread | CPU s over the mix |", "|---|---|---|"]
    for path in paths[1:]:
        thread_rows += [f"| {path} | {name} | {s} |" for name, s in
                        list(result[path]["mix"].get("worker_thread_cpu_s", {}).items())[:8]]
    served = "; ".join(f"{path} {result[path]['mix']['output_tok_s']:.0f} "
                       f"({result[path]['mix']['output_tok_s'] / mix['engine']:.2f} of the "
                       f"engine's)" for path in paths[1:])
    targets = result.get("targets_by_variant", {"served": result["targets_met"]})
    round_rows = ["| path | round | engine loop tok/s | served tok/s | served / loop |",
                  "|---|---|---|---|---|"]
    for path in paths[1:]:
        round_rows += [f"| {path} | {i} | {r['engine_loop_tok_s']:.0f} | {r['served_tok_s']:.0f} "
                       f"| {r['served_over_loop']:.3f} |"
                       for i, r in enumerate(result[path].get("rounds", []), 1)]
    ratios = "; ".join(f"{path} {mix_ratio(result['inproc'], result[path]):.3f}"
                       for path in paths[1:])
    return (f"# serve_gpu: the served path on {result['device']}\n\n`{result['command']}` "
            f"({result['date']}, {result['commit']}); {result['shape']}, "
            f"{result['num_requests']} requests, {result['clients']} client processes, "
            f"{result['routers']} router(s).\n\n"
            + "\n".join(rows) + "\n\n" + "\n".join(loop_rows) + "\n\n" + "\n".join(cpu_rows)
            + ("\n\n" + "\n".join(thread_rows) if len(thread_rows) > 2 else "")
            + ("\n\nRounds (the engine loop, then served, on each round's own mix):\n\n"
               + "\n".join(round_rows) if len(round_rows) > 2 else "")
            + f"\n\nServed over the engine loop (the median of the rounds'): {ratios}."
            + "\n\nMix output tok/s: the engine stepped in a loop "
            f"{mix['engine']:.0f}, streamed in-process (AsyncEngine) "
            f"{mix['stream']:.0f}, "
            f"{served}. Targets: {json.dumps(targets)}\n")


VARIANTS = ("serve", "direct", "ingress", "ingress_direct", "ingress_intake")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b", help="a DUMMY_MODELS name, or tiny")
    ap.add_argument("--num-requests", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-gb", type=float, default=16.0)
    ap.add_argument("--clients", type=int, default=8, help="load-generating processes")
    ap.add_argument("--routers", type=int, default=1, help="router replicas")
    ap.add_argument("--streams-per-token", type=int, default=8,
                    help="ServeConfig.streaming: one more token a message per this many streams "
                         "(the config's default: 8)")
    ap.add_argument("--max-tokens-per-message", type=int, default=16)
    ap.add_argument("--b1-requests", type=int, default=8)
    ap.add_argument("--variants", default="serve",
                    help="served runs, each its own Ray session, of: serve (outputs as Serve "
                         "stream messages), direct (ServeConfig.streaming.direct), both through "
                         "Serve's proxy; ingress (the routers answer the port themselves: "
                         "ServeConfig.ingress routers), ingress_direct (both), ingress_intake "
                         "(both, and requests over the routers' intake connections: "
                         "ServeConfig.streaming.intake)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="after each served run, this many mixes each run by the in-process "
                         "engine in a loop and then served (the mix target: the median of "
                         "their ratios)")
    ap.add_argument("--py-spy", default=None, metavar="BINARY",
                    help="record the worker process over each served mix with this py-spy "
                         "(GIL-holding samples by thread; a .py-spy.txt next to --out)")
    ap.add_argument("--out", default="bench/results/serve_gpu.json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch

    from mxserve.worker.model.dummy import DUMMY_MODELS

    vocab = (TINY if args.shape == "tiny" else DUMMY_MODELS[args.shape])["vocab_size"]
    model = model_dir(args.shape, args.max_model_len)
    mix = make_mix(args.num_requests, vocab, args.max_model_len)
    b1 = make_mix(args.b1_requests, vocab, args.max_model_len, seed=1)
    b1 = ([p[:256] for p in b1[0]], [128] * args.b1_requests)
    warm_prompts, warm_outs = make_mix(min(64, args.num_requests), vocab, args.max_model_len,
                                       seed=2)
    warm = (warm_prompts, [min(k, 32) for k in warm_outs])
    from mxserve.worker.config import EngineConfig
    from mxserve.worker.engine import build_engine

    raw = build_engine(EngineConfig(model=model, **engine_options(args)))
    inproc = run_inproc(raw, mix, b1, warm)
    print("in-process:", json.dumps(inproc), flush=True)
    rounds = [make_mix(args.num_requests, vocab, args.max_model_len, seed=100 + i)
              for i in range(args.rounds)]
    variants = {}
    for name in args.variants.split(","):
        if name not in VARIANTS:
            raise SystemExit(f"--variants: of {', '.join(VARIANTS)}, got {name!r}")
        path = "served" if name == "serve" else f"served_{name}"
        variants[path] = run_served(args, model, mix, b1, warm, direct="direct" in name
                                    or "intake" in name, ingress="ingress" in name,
                                    intake="intake" in name, raw=raw, rounds=rounds)
        print(f"{path}:", json.dumps(variants[path]), flush=True)
    by_variant = {path: targets(inproc, out) for path, out in variants.items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    import grpc
    import ray
    result = {"bench": "serve_gpu", "device": device,
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "commit": head_commit(), "command": "python bench/serve_gpu.py "
              + " ".join(sys.argv[1:]),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "ray": ray.__version__, "grpcio": grpc.__version__},
              "shape": args.shape, "num_requests": args.num_requests, "clients": args.clients,
              "routers": args.routers, "streaming": {
                  "streams_per_token": args.streams_per_token,
                  "max_tokens_per_message": args.max_tokens_per_message},
              "inproc": inproc, **variants, "served_variants": list(variants),
              "targets_by_variant": by_variant,
              # the served path that meets the targets (ingress routers, direct streams,
              # request intake: the defaults) where it ran, else the last of
              # --variants
              "targets_met": by_variant.get("served_ingress_intake",
                                            by_variant[list(variants)[-1]])}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_result(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
