"""Where does a top_p sampler call spend the host's time on the GPU? One call, a profile.

Flat [B, 128256] logits (as dummy weights give), temperature 0.7 and top_p 0.9, unseeded, with
the cutoff decided on the device and from the host. Reports the host wall time of
`Sampler.sample` (queueing, no wait) and of it plus the wait, and torch.profiler's top host ops.

    python bench/sampler_probe.py --out $OUT/sampler_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch
import triton

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.request import Request
from mxserve.worker.sampler import Sampler


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/sampler_probe.json")
    ap.add_argument("--batches", default="1,64")
    args = ap.parse_args()
    rows = []
    params = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True)
    for batch in [int(b) for b in args.batches.split(",")]:
        logits = torch.randn(batch, 128256, device="cuda") * 0.02
        requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(batch)]
        for on_device in (True, False):
            sampler = Sampler(0, top_p_on_device=on_device)
            for _ in range(5):
                sampler.sample(logits.clone(), requests).result()
            torch.cuda.synchronize()
            queue, total = [], []
            for _ in range(30):
                x = logits.clone()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = sampler.sample(x, requests)
                t1 = time.perf_counter()
                out.result()
                t2 = time.perf_counter()
                queue.append((t1 - t0) * 1e3)
                total.append((t2 - t0) * 1e3)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    sampler.sample(logits.clone(), requests).result()
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=18,
                                              max_name_column_width=48)
            row = {"batch": batch, "on_device": on_device,
                   "queue_ms_p50": round(statistics.median(queue), 3),
                   "total_ms_p50": round(statistics.median(total), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(table, flush=True)
    result = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "triton": triton.__version__,
              "command": " ".join(sys.argv), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
