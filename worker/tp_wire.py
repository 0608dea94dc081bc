"""A StepPlan as bytes, for the other ranks of a tensor-parallel group (tp_executor.py).

The other ranks run the same model step as rank 0, so they need what the model runner reads of
the plan and nothing else: per scheduled request its tokens, positions, block table (and its
version, which the CUDA graphs keep tables by), whether it samples, where its in-flight
token is, and the prompt tokens it returns logprobs of (the ranks compute them alike: the logits
gather the vocabulary over the group); and the KV moves of eviction and whether to return
attention mass. One flat int64 array:

    [num_scheduled, num_decodes, num_inflight_tokens, mass_window, num_kv_moves,
     then per request: num_new_tokens, start_position, table_version, samples, inflight_row,
                       num_draft_tokens, len(token_ids), len(block_table), position_offset,
                       num_prompt_logprobs, len(prompt_logprob_ids),
     then every request's token_ids, then every request's block_table, then every request's
     prompt_logprob_ids,
     then per KV move: its length n, n source slots, n destination slots]

The in-flight tokens themselves stay on the device: rank 0 broadcasts them over the group.
"""

from __future__ import annotations

import numpy as np

from mxserve.worker.scheduler import ScheduledRequest, StepPlan

_HEADER, _PER_REQUEST = 5, 11


def encode_plan(plan: StepPlan) -> bytes:
    sched = plan.scheduled
    inflight = plan.inflight_tokens
    uses_inflight = inflight is not None and any(s.inflight_row >= 0 for s in sched)
    head = [len(sched), plan.num_decodes, inflight.numel() if uses_inflight else 0,
            plan.mass_window, len(plan.kv_moves)]
    rows: list[int] = []
    tokens: list[int] = []
    tables: list[int] = []
    prompt_ids: list[int] = []
    for s in sched:
        rows += (s.num_new_tokens, s.start_position, s.table_version, s.samples, s.inflight_row,
                 s.num_draft_tokens, len(s.token_ids), len(s.block_table), s.position_offset,
                 s.num_prompt_logprobs, len(s.prompt_logprob_ids))
        tokens += s.token_ids
        tables += s.block_table
        prompt_ids += s.prompt_logprob_ids
    parts = [np.array(head + rows + tokens + tables + prompt_ids, dtype=np.int64)]
    for src, dst in plan.kv_moves:
        parts += [np.array([len(src)], dtype=np.int64), np.asarray(src, dtype=np.int64),
                  np.asarray(dst, dtype=np.int64)]
    return np.concatenate(parts).tobytes()


def decode_plan(data: bytes) -> tuple[StepPlan, int]:
    """(the plan without requests or in-flight tokens, how many in-flight tokens rank 0 will
    broadcast for it: 0 when none)."""
    a = np.frombuffer(data, dtype=np.int64)
    num, num_decodes, num_inflight, mass_window, num_moves = (int(x) for x in a[:_HEADER])
    rows = a[_HEADER:_HEADER + num * _PER_REQUEST].reshape(num, _PER_REQUEST).tolist()
    rest = a[_HEADER + num * _PER_REQUEST:].tolist()
    at = 0
    token_ids = []
    for row in rows:
        token_ids.append(rest[at:at + row[6]])
        at += row[6]
    plan = StepPlan(num_decodes=num_decodes, mass_window=mass_window)
    for row, ids in zip(rows, token_ids):
        num_new, start, version, samples, inflight_row, num_drafts, _, num_blocks, offset = row[:9]
        plan.scheduled.append(ScheduledRequest(None, num_new, start, ids, rest[at:at + num_blocks],
                                               version, bool(samples), inflight_row, num_drafts,
                                               offset, num_prompt_logprobs=row[9]))
        at += num_blocks
    for row, s in zip(rows, plan.scheduled):
        s.prompt_logprob_ids = rest[at:at + row[10]]
        at += row[10]
    for _ in range(num_moves):
        n = rest[at]
        plan.kv_moves.append((rest[at + 1:at + 1 + n], rest[at + 1 + n:at + 1 + 2 * n]))
        at += 1 + 2 * n
    return plan, num_inflight
