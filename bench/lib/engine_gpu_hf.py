"""bench/engine_gpu.py's baselines: transformers' LlamaForCausalLM on the same dummy weights
(the HF section) and prefix caching on vs off over multi-turn conversations."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from engine_gpu_common import GREEDY, free, hf_config_dict, make_llm, sync

from mxserve import LLM, SamplingParams
from mxserve.worker.model.dummy import DummySource


def load_hf(args, shape: str):
    import transformers

    cfg = transformers.LlamaConfig(**hf_config_dict(shape))
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model, cfg


def hf_section(args, shape: str, llm) -> dict:
    """HF generate at several batch sizes on our weights; greedy agreement on 4 prompts."""
    model, _ = load_hf(args, shape)
    state = model.state_dict()
    ours = llm.engine.runner
    source = DummySource(llm.engine.model_config, ours.device, torch.bfloat16, llm.config.seed)
    with torch.no_grad():
        for name, t in source.tensors():
            state[name].copy_(t)
    gen = torch.Generator().manual_seed(2)
    vocab = llm.engine.model_config.vocab_size
    res, new = {"batches": []}, args.hf_new_tokens

    def prompts(batch: int, prompt_len: int) -> torch.Tensor:
        return torch.randint(10, vocab - 10, (batch, prompt_len), generator=gen).to(args.device)

    hf_generate(model, prompts(2, 16), 4)  # warm-up
    for batch in args.hf_batches:
        ids = prompts(batch, args.hf_prompt_len)
        sync()
        t0 = time.perf_counter()
        hf_generate(model, ids, new)
        sync()
        wall = time.perf_counter() - t0
        res["batches"].append({"batch": batch, "wall_s": round(wall, 3),
                               "tok_s": round(batch * new / wall, 1)})
    best = max(res["batches"], key=lambda r: r["tok_s"])
    res.update(best_batch=best["batch"], best_tok_s=best["tok_s"], prompt_len=args.hf_prompt_len,
               new_tokens=new)
    checks = [prompts(1, n) for n in (7, 40, 99, 160)]
    hf_out = [hf_generate(model, ids, 32)[0].tolist() for ids in checks]
    our_out = [o.token_ids for o in llm.generate([ids[0].tolist() for ids in checks],
                                                 SamplingParams(max_tokens=32, **GREEDY))]
    res["greedy_matching_prefix"] = [common_prefix(a, b) for a, b in zip(our_out, hf_out)]
    del model, state
    free()
    return res


def hf_generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Exactly n greedy new tokens for each row of ids [B, L] -> [B, n]."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[:, ids.shape[1]:]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_conversations(llm, system: list[int], users: list[list[list[int]]],
                      out_len: int) -> tuple[float, list[list[int]], int]:
    histories = [list(system) for _ in users]
    outputs, cached = [], 0
    t0 = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [h + u[turn] for h, u in zip(histories, users)]
        results = llm.generate(prompts, SamplingParams(max_tokens=out_len, **GREEDY))
        for h, p, r in zip(histories, prompts, results):
            h[:] = p + r.token_ids
        outputs += [r.token_ids for r in results]
        cached += sum(r.num_cached_tokens for r in results)
    return time.perf_counter() - t0, outputs, cached


def prefix_section(args, shape: str, llm_on) -> dict:
    vocab = llm_on.engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    system = rng.integers(10, vocab - 10, args.system_len).tolist()
    users = [[rng.integers(10, vocab - 10, int(np.clip(rng.lognormal(np.log(64), 0.5), 16, 256)))
              .tolist() for _ in range(args.turns)] for _ in range(args.conversations)]
    res = {"system_len": args.system_len, "conversations": args.conversations,
           "turns": args.turns, "output_len": args.turn_out}
    wall_on, out_on, cached_on = run_conversations(llm_on, system, users, args.turn_out)
    free()
    llm_off, _ = make_llm(args, shape, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batched_tokens,
                          kv_cache_memory_gb=args.kv_gb, enable_prefix_caching=False)
    run_conversations(llm_off, system[:64], [u[:1] for u in users[:8]], 8)  # warm-up
    wall_off, out_off, cached_off = run_conversations(llm_off, system, users, args.turn_out)
    del llm_off
    free()
    num_out = len(out_on) * args.turn_out
    res.update(on_wall_s=round(wall_on, 3), off_wall_s=round(wall_off, 3),
               on_output_tok_s=round(num_out / wall_on, 1),
               off_output_tok_s=round(num_out / wall_off, 1),
               on_cached_prompt_tokens=cached_on, off_cached_prompt_tokens=cached_off,
               speedup=round(wall_off / wall_on, 2),
               identical_outputs=sum(a == b for a, b in zip(out_on, out_off)),
               num_outputs=len(out_on),
               mean_matching_prefix=round(statistics.mean(
                   common_prefix(a, b) for a, b in zip(out_on, out_off)), 2))
    return res


def prefix_fp32_check(args, shape: str) -> dict:
    """Same outputs with prefix caching on and off, in float32 (bf16 runs of random weights part
    at near-ties of the logits, see the JSON): a smaller multi-turn run."""
    outs = {}
    for caching in (True, False):
        llm = LLM(model=shape, load_format="dummy", dtype="float32", load_progress=False,
                  device=args.device, max_model_len=args.max_model_len, max_num_seqs=16,
                  kv_cache_memory_gb=4.0, enable_prefix_caching=caching)
        vocab = llm.engine.model_config.vocab_size
        system = np.random.default_rng(4).integers(10, vocab - 10, args.system_len // 4).tolist()
        users = [[np.random.default_rng(10 * c + t).integers(10, vocab - 10, 24).tolist()
                  for t in range(2)] for c in range(16)]
        _, outs[caching], cached = run_conversations(llm, system, users, 32)
        outs[f"cached_{caching}"] = cached
        del llm
        free()
    return {"conversations": 16, "turns": 2, "output_len": 32, "system_len": args.system_len // 4,
            "cached_prompt_tokens_on": outs["cached_True"],
            "identical_outputs": sum(a == b for a, b in zip(outs[True], outs[False])),
            "num_outputs": len(outs[True])}
