#!/usr/bin/env bash
# One GPU call (session 10): the attention and graph tests after the fused split merge, the
# graph kernel profile, the batch-1 engine steps. Writes under $OUT.
set -u
python3 -m pytest -q --no-header -p no:cacheprovider tests/gpu/test_paged_attention_gpu.py \
  ${TESTS:-} 2>&1 | tee $OUT/gpu_tests.log | grep -E "passed|failed|paged .* us" | tail -8
python3 bench/graph_profile.py --out $OUT/graph_profile.json --cases ${CASES:-llama-3.2-1b:bf16} \
  2>&1 | grep -v -i warn | tail -30
if [ -n "${ENGINE:-}" ]; then
  timeout 240 python3 bench/engine_gpu.py --shapes llama-3.2-1b,llama-3-8b --sections batch1,mx \
    --out $OUT --deadline-s 220 2>&1 | grep -A8 "batch-1 decode" | head -12
fi
