"""bench/engine_gpu.py's report: the environment header, sections run one by one and written as
they end (a failing one records its error), the summary against the targets, the markdown."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
import traceback

import torch
from engine_gpu_common import REPO

TARGETS = {"batch1_vs_roofline_max": 1.5, "mxfp4_vs_bf16_batch1_min": 2.5,
           "mix_vs_hf_min": 20.0, "prefix_on_vs_off_min": 3.0}


def environment(args) -> dict:
    import transformers
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"device": dev, "date": now,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "transformers": transformers.__version__,
                         "cuda": torch.version.cuda, "git_head_where_run": commit},
            "command": " ".join(["python", "bench/engine_gpu.py", *sys.argv[1:]])}


class Report:
    def __init__(self, args) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.data = {**environment(args), "targets": TARGETS, "sections": {}, "errors": {}}

    def run(self, name: str, fn, *a):
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.data["errors"][name] = "skipped: past --deadline-s"
            return None
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {name} ...", flush=True)
        try:
            out = fn(*a)
        except Exception:
            self.data["errors"][name] = traceback.format_exc()[-3000:]
            print(self.data["errors"][name], flush=True)
            return None
        result = out[0] if isinstance(out, tuple) else out
        self.data["sections"][name] = result
        print(json.dumps(result)[:600], flush=True)
        self.write()
        return out

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.data["summary"] = summary(self.data["sections"])
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "engine_gpu.json"), "w") as f:
            json.dump(self.data, f, indent=1)
        with open(os.path.join(self.args.out, "engine_gpu.md"), "w") as f:
            f.write(markdown(self.data))


def summary(s: dict) -> dict:
    out = {}
    for shape in ("1b", "8b"):
        bf, mx = s.get(f"{shape}_bf16_batch1"), s.get(f"{shape}_mxfp4_batch1")
        if bf:
            out[f"{shape}_bf16_step_vs_roofline"] = bf.get("engine_step_vs_roofline")
            out[f"{shape}_bf16_graph_replay_vs_roofline"] = bf.get("graph_replay_vs_roofline")
        if bf and mx:
            out[f"{shape}_mxfp4_speedup_vs_bf16_step"] = round(
                bf["engine_step_ms_p50"] / mx["engine_step_ms_p50"], 3)
        head = s.get(f"{shape}_mxfp4_head_batch1")
        if bf and head:  # quantize_lm_head
            out[f"{shape}_mxfp4_head_speedup_vs_bf16_step"] = round(
                bf["engine_step_ms_p50"] / head["engine_step_ms_p50"], 3)
    if s.get("1b_mix") and s.get("1b_hf"):
        out["1b_mix_vs_hf_best"] = round(s["1b_mix"]["output_tok_s"] / s["1b_hf"]["best_tok_s"], 2)
    if s.get("1b_prefix"):
        out["1b_prefix_on_vs_off"] = s["1b_prefix"]["speedup"]
    met = {"batch1_vs_roofline": ("1b_bf16_step_vs_roofline", "<=", "batch1_vs_roofline_max"),
           "mxfp4_vs_bf16_batch1": ("1b_mxfp4_speedup_vs_bf16_step", ">=",
                                    "mxfp4_vs_bf16_batch1_min"),
           "mix_vs_hf": ("1b_mix_vs_hf_best", ">=", "mix_vs_hf_min"),
           "prefix_on_vs_off": ("1b_prefix_on_vs_off", ">=", "prefix_on_vs_off_min")}
    out["targets_met"] = {k: (out[v] <= TARGETS[t] if op == "<=" else out[v] >= TARGETS[t])
                          for k, (v, op, t) in met.items() if out.get(v) is not None}
    return out


def markdown(d: dict) -> str:
    s, summ = d["sections"], d["summary"]
    lines = [f"# engine_gpu ({d['device']}, {d['date']})", "", f"`{d['command']}`; torch "
             f"{d['versions']['torch']}, triton {d['versions']['triton']}, transformers "
             f"{d['versions']['transformers']}. Dummy weights (N(0, 0.02)), bf16 activations.", ""]
    if "copy_bandwidth" in s:
        lines.append(f"Copy bandwidth: {s['copy_bandwidth']['tb_per_s']} TB/s (1 GiB d2d, r+w).")
    lines += ["", "| batch-1 decode | roofline ms | graph replay ms | engine step ms | "
              "sync engine step ms | eager step ms | step / roofline |",
              "|---|---|---|---|---|---|---|"]
    for key in ("1b_bf16_batch1", "1b_mxfp4_batch1", "1b_mxfp4_head_batch1", "8b_bf16_batch1",
                "8b_mxfp4_batch1", "8b_mxfp4_head_batch1"):
        r = s.get(key)
        if r:
            lines.append(f"| {key} | {r['roofline_ms']} | {r.get('graph_replay_ms_p50')} | "
                         f"{r['engine_step_ms_p50']} | {r.get('sync_engine_step_ms_p50')} | "
                         f"{r.get('eager_step_ms_p50')} | {r.get('engine_step_vs_roofline')} |")
    for key in ("1b_mix", "8b_mix"):
        if not s.get(key):
            continue
        m = s[key]
        lines += ["", (
            f"Mix ({key[:2].upper()} bf16, {m['num_requests']} requests at once, "
            f"{m['output_tokens']} output tokens): {m['output_tok_s']} output tok/s "
            f"({m['total_tok_s']} incl. prompts); TTFT p50/p99 {m['ttft_ms_p50']}/"
            f"{m['ttft_ms_p99']} ms; TPOT p50/p99 {m['tpot_ms_p50']}/{m['tpot_ms_p99']} ms; "
            f"KV pool occupancy peak {m['kv_occupancy_peak']}, mean while requests queued "
            f"{m['kv_occupancy_mean_while_queued']}; block fill {m['kv_fill_mean']}; "
            f"preemptions {m['num_preemptions']}.")]
        lines += [f"Time in engine.step() parts over the mix (s): {m.get('phase_s')} (execute "
                  "and sample launch asynchronously; complete waits for the GPU)."]
        if m.get("sync"):
            lines += [f"Async scheduling off, same requests: {m['sync']['output_tok_s']} output "
                      f"tok/s (async: {m['async_vs_sync_tok_s']}x), TPOT p50/p99 "
                      f"{m['sync']['tpot_ms_p50']}/{m['sync']['tpot_ms_p99']} ms."]
    for key, what in (("1b_decode_sweep", "greedy"),
                      ("1b_decode_sweep_eager_sampler",
                       "greedy, the argmax kernels launched one by one"),
                      ("1b_decode_sweep_top_p", "temperature 0.7, top_p 0.9"),
                      ("1b_decode_sweep_top_p_eager_sampler",
                       "temperature 0.7, top_p 0.9, the sampler's kernels launched one by one"),
                      ("1b_decode_sweep_top_p_host",
                       "temperature 0.7, top_p 0.9, cutoff checked from the host")):
        if not s.get(key):
            continue
        lines += ["", f"Decode sweep ({what}):", "", "| decode batch | engine step ms, async | "
                  "sync | graph replay ms (padded size) | async: schedule / execute / sample / "
                  "complete ms (mean) |", "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['engine_step_ms_p50']} | "
                  f"{r.get('sync_engine_step_ms_p50')} | {r.get('graph_replay_ms_p50')} "
                  f"({r.get('graph_size')}) | "
                  f"{' / '.join(str(v) for v in r.get('phase_ms_mean', {}).values())} |"
                  for r in s[key]["rows"]]
    if s.get("1b_hf"):
        h = s["1b_hf"]
        rows = ", ".join(f"b{r['batch']}: {r['tok_s']}" for r in h["batches"])
        lines += ["", f"HF generate (same weights, {h['prompt_len']}-token prompts, "
                  f"{h['new_tokens']} new): {rows} tok/s; greedy matching prefix vs ours (of 32): "
                  f"{h['greedy_matching_prefix']}."]
        if s.get("1b_mix"):
            ratios = ", ".join(f"b{r['batch']}: {s['1b_mix']['output_tok_s'] / r['tok_s']:.1f}x"
                               for r in h["batches"])
            lines.append(f"Our mix output tok/s over HF's at each batch size: {ratios}.")
    if s.get("1b_prefix"):
        p = s["1b_prefix"]
        lines += ["", f"Prefix caching ({p['system_len']}-token system prompt, "
                  f"{p['conversations']} conversations x {p['turns']} turns): on "
                  f"{p['on_wall_s']} s, off {p['off_wall_s']} s -> {p['speedup']}x; identical "
                  f"outputs {p['identical_outputs']}/{p['num_outputs']} (bf16; mean matching "
                  f"prefix {p.get('mean_matching_prefix')} of {p['output_len']} tokens)."]
    if s.get("1b_prefix_fp32"):
        f = s["1b_prefix_fp32"]
        lines += [f"Same in float32 ({f['conversations']} conversations x {f['turns']} turns, "
                  f"{f['system_len']}-token system prompt): identical outputs "
                  f"{f['identical_outputs']}/{f['num_outputs']}."]
    lines += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    names = {"batch1_vs_roofline": ("1b_bf16_step_vs_roofline", "<= 1.5"),
             "mxfp4_vs_bf16_batch1": ("1b_mxfp4_speedup_vs_bf16_step", ">= 2.5"),
             "mix_vs_hf": ("1b_mix_vs_hf_best", ">= 20"),
             "prefix_on_vs_off": ("1b_prefix_on_vs_off", ">= 3")}
    for k, (v, target) in names.items():
        lines.append(f"| {v} | {summ.get(v)} | {target} | {summ['targets_met'].get(k)} |")
    if d["errors"]:
        lines += ["", "Sections that failed or were skipped: " + ", ".join(d["errors"])]
    return "\n".join(lines) + "\n"
