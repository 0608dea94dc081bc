"""mxserve.api: what the router and the worker both speak, and nothing that needs torch.

Sampling parameters, errors and their gRPC codes, block hashes, the output delta a worker
streams, the tokenizer, the output stream (incremental detokenization and stop strings) and the
prefix-index client. `router/` and `worker/` import these and never each other; `cluster/` wires
the two (docs/architecture.md, "Layout and import rules").
"""
