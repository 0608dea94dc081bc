"""The `mxserve` command: generate and chat offline; serve a model on Ray Serve and talk to it
over gRPC (client, chat --endpoint); quantize a checkpoint to MX.

Building the parser imports nothing heavy (no torch, triton or ray), so `mxserve --help` and a
bad flag answer at once; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys

from mxserve.api.errors import InvalidRequestError, MxserveError
from mxserve.worker.config import KV_EVICTION_POLICIES, MX_QUANTIZATIONS


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--quantization", default=None, choices=sorted(MX_QUANTIZATIONS),
                   help="MX weights for the decoder linears, quantized while loading")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="the LM head in the same MX format too (needs an MX model)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks of one engine: this process and N - 1 local processes "
                        "(one GPU each on CUDA)")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "eagle", '
                        '"num_speculative_tokens": 3}\' or {"method": "ngram"}')
    p.add_argument("--kv-eviction", default=None, choices=KV_EVICTION_POLICIES,
                   help="drop KV past --kv-budget: heavy hitters + recent + sinks (h2o) or "
                        "recent + sinks (streaming)")
    p.add_argument("--kv-budget", type=_budget, default=None, metavar="N|F",
                   help="KV tokens a request keeps: a count, or a fraction (0 < F < 1) of its "
                        "length")
    p.add_argument("--h2o-recent", type=int, default=None,
                   help="newest tokens always kept (default: half the budget)")
    p.add_argument("--h2o-sinks", type=int, default=None,
                   help="first tokens always kept (default 4)")


def _budget(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        return float(text)


# Sampling flags: unset ones take the model's defaults (docs/sampling.md), as in the API.
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (unset: the model's defaults, see docs/sampling.md)")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="default: until the end of the answer (EOS) or of the context")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    chat = sub.add_parser("chat", help="interactive chat with streamed answers")
    chat.add_argument("--endpoint", default=None,
                      help="chat with an mxserve server at host:port instead of in-process")
    chat.add_argument("--app", default="mxserve", help="Serve application name (--endpoint)")
    for p in (gen, chat):
        _engine_args(p)
        _sampling_args(p)
    _serve_parser(sub)
    _client_parser(sub)
    _quantize_parser(sub)
    _train_draft_parser(sub)
    _draft_server_parser(sub)
    _drain_parser(sub)
    return parser


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _train_draft_parser(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE draft head for speculative decoding",
                       description="Self-distillation (worker/eagle_train.py): the target "
                                   "answers chat prompts, the head learns from its hidden "
                                   "states; resumable; reports acceptance on held-out prompts.")
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="work directory; the head goes to OUT/head")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128, help="answer length")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--heldout", type=int, default=32,
                   help="held-out prompts the engine speculates on for the report (0: only the "
                        "teacher-forced agreement)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--text-tokens", type=int, default=0,
                   help="also learn from this many tokens of KJV text (prefill only: cheap)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=4096, help="answer tokens a step, about")
    p.add_argument("--unroll-steps", type=int, default=2,
                   help="drafting steps trained, each on the KV the drafter's chain sees")
    p.add_argument("--cls-weight", type=float, default=0.1,
                   help="the soft cross-entropy's weight (the target's next-token distribution)")
    p.add_argument("--feature-weight", type=float, default=1.0,
                   help="the feature regression's weight (0: the cross-entropy alone)")
    p.add_argument("--cls-fraction", type=float, default=0.25,
                   help="answer positions a step computes the cross-entropy on (a "
                        "vocabulary-wide product: most of a step's cost on a CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the target in bf16 there)")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="drafts come from the N tokens the target writes most (0: all)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the target's batch when "
                   "answering the prompts (a GPU takes hundreds)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--init-head", default=None, help="start from this head's weights (a head "
                   "directory train-draft wrote) instead of random ones: more training on new "
                   "data (give another --seed)")
    p.add_argument("--head-intermediate-size", type=int, default=None,
                   help="a new head's MLP width (default the target's): more capacity at the "
                   "same KV and attention cost")
    p.add_argument("--seed", type=int, default=0, help="the prompts, text windows, initial "
                   "weights and batch order")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over gRPC on Ray Serve (Ctrl-C to stop)",
                       description="Start a local Ray cluster (or use --address) and serve the "
                                   "model: a router ingress and worker replicas behind Ray "
                                   "Serve's gRPC proxy.")
    p.add_argument("--config", default=None, help="YAML/JSON file of ServeConfig fields "
                                                  "(cluster/config.py); flags override it")
    p.add_argument("--address", default=None,
                   help="deploy onto this existing Ray cluster (e.g. 'auto', 'ray://head:10001')"
                        " and return, instead of starting a local one")
    p.add_argument("--model", default=None,
                   help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", default=None, help="the name clients use (default: derived)")
    p.add_argument("--num-workers", type=int, default=None, help="worker replicas (default 1)")
    p.add_argument("--worker-cpus", type=float, default=None, help="CPUs per worker (default 1)")
    p.add_argument("--worker-gpus", type=float, default=None, help="GPUs per worker (default 0)")
    p.add_argument("--host", default=None,
                   help="address the local cluster's ports listen on (default 127.0.0.1; "
                        "0.0.0.0 exposes them to the network)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 9000)")
    p.add_argument("--ingress", default=None, choices=["routers", "proxy"],
                   help="who answers the gRPC and HTTP ports: the routers themselves (default) "
                        "or Ray Serve's proxies (several apps on one cluster; docs/serving.md)")
    p.add_argument("--http-port", type=int, default=None,
                   help="HTTP port: OpenAI's API, {route prefix}/v1/... (default 8000)")
    p.add_argument("--route-prefix", default=None,
                   help="the app's HTTP path prefix (default /; apps sharing a Ray cluster "
                        "need different ones)")
    p.add_argument("--app-name", default=None,
                   help="the Serve application's name; gRPC clients send it as `application` "
                        "metadata (default mxserve)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Ray's Prometheus metrics port (local cluster; default 8080)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="per worker, beyond those running (default 64)")
    p.add_argument("--request-timeout-s", type=float, default=None)
    p.add_argument("--redis-url", default=None,
                   help="Redis for the global prefix index, redis://[:password@]host:port/db "
                        "(rediss:// for TLS); default: start a local redis-server")
    p.add_argument("--ask", default=None, metavar="QUESTION",
                   help="once serving, ask this over gRPC, print the answer and shut down")
    p.add_argument("--draft-replicas", type=int, default=None,
                   help="draft replicas (with speculative_config draft_placement 'replica'; "
                        "default 1)")
    p.add_argument("--draft-cpus", type=float, default=None, help="CPUs per draft replica")
    p.add_argument("--draft-gpus", type=float, default=None,
                   help="GPUs per draft replica (a fraction shares a GPU; default 0)")
    p.add_argument("--kv-transfer", action="store_true", default=None,
                   help="workers pull cached prefixes from each other over gRPC when that "
                        "beats computing them (kv_transfer in the config file for its options)")
    p.add_argument("--num-routers", type=int, default=None,
                   help="router replicas (default 1; on a GPU worker 2 or more keep the "
                        "served path up with the engine: bench/results/serve_gpu.md)")
    p.add_argument("--streams-per-token", type=int, default=None,
                   help="under load a stream's message carries one more token per this many "
                        "streams running (default 8; docs/serving.md)")
    p.add_argument("--max-tokens-per-message", type=int, default=None,
                   help="the most tokens a message carries under load (default 16; 1: one "
                        "token a message)")
    p.add_argument("--direct-streams", action=argparse.BooleanOptionalAction, default=None,
                   help="workers send outputs to the routers over TCP, not as Serve stream "
                        "messages (streaming.direct; default on unless kv_transfer uses TLS; "
                        "docs/serving.md)")
    p.add_argument("--request-intake", action=argparse.BooleanOptionalAction, default=None,
                   help="routers route each request themselves and send it to the worker over "
                        "TCP, not as a Serve call (streaming.intake; needs direct streams and "
                        "--routing prefix; default on where both are; docs/serving.md)")
    p.add_argument("--routing", default=None, choices=["prefix", "power_of_two", "round_robin"],
                   help="how the router picks a worker (default prefix: cached prefix minus "
                        "load, via Redis; the others need no Redis)")
    for name, kind in (("dtype", str), ("device", str), ("max-model-len", int),
                       ("max-num-seqs", int), ("max-num-batched-tokens", int),
                       ("num-kv-blocks", int), ("kv-cache-memory-gb", float),
                       ("num-threads", int), ("tensor-parallel-size", int),
                       ("speculative-config", _json_object), ("kv-budget", _budget),
                       ("h2o-recent", int), ("h2o-sinks", int)):
        p.add_argument(f"--{name}", type=kind, default=None, help="engine option")
    p.add_argument("--kv-eviction", default=None, choices=KV_EVICTION_POLICIES,
                   help="engine option: KV eviction past --kv-budget")


def _draft_server_parser(sub) -> None:
    p = sub.add_parser("draft-server", help="serve a model's EAGLE head for workers whose "
                       "speculative_config has draft_placement 'replica' (Ctrl-C to stop)")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="default: a free port (printed)")
    p.add_argument("--num-blocks", type=int, default=4096,
                   help="the head's KV pool, in blocks of the target's block size")


def _drain_parser(sub) -> None:
    p = sub.add_parser("drain", help="have a worker hand its running requests to the other "
                       "workers and take no new ones (before taking it down)",
                       description="The worker's streams go on on other workers without a "
                                   "break; with KV transfer on they pull its KV instead of "
                                   "computing it again. Worker ids: the Health RPC's workers, "
                                   "or the worker's log lines.")
    p.add_argument("--worker", required=True, help="the worker replica's id")
    p.add_argument("--app", default="mxserve", help="Serve application name")
    p.add_argument("--address", default="auto", help="the Ray cluster (default %(default)s)")


def _client_parser(sub) -> None:
    p = sub.add_parser("client", help="send one prompt to an mxserve server and stream the answer")
    p.add_argument("prompt")
    p.add_argument("--endpoint", default="127.0.0.1:9000", help="host:port (default %(default)s)")
    p.add_argument("--app", default="mxserve", help="Serve application name")
    p.add_argument("--model", default="", help="model name (default: the served one)")
    p.add_argument("--completion", action="store_true",
                   help="send the prompt as raw text instead of a chat message")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _sampling_args(p)


def _quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write an MX-quantized copy of a checkpoint (mxfp4/mxfp6)",
                       description="Write an MX-quantized copy of a checkpoint that the engine "
                                   "serves as is (worker/model/quantize.py).")
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--format", required=True, choices=sorted(MX_QUANTIZATIONS),
                   help="mxfp4 = e2m1, mxfp6 = e2m3, mxfp6_e3m2 = e3m2 (unclipped block scales)")
    p.add_argument("--out", required=True, help="output directory (created; must be empty)")
    p.add_argument("--device", default="auto", help="where to quantize (default: CUDA if any)")
    p.add_argument("--method", default="rtn", choices=("rtn", "gptq"),
                   help="rtn: round to nearest; gptq: compensate rounding errors against the "
                        "layers' inputs on --calibration text")
    p.add_argument("--calibration", default=None, help="UTF-8 text file for --method gptq")
    p.add_argument("--calibration-tokens", type=int, default=16384,
                   help="calibration tokens used (windows of 512)")


def _sampling_fields(args) -> dict:
    """The sampling flags the user set."""
    return {name: getattr(args, name) for name in SAMPLING_FLAGS
            if getattr(args, name) is not None}


def _check_request(prompt: str | None, args) -> None:
    """Reject an empty prompt or a bad sampling flag before any model loads or call is made
    (prompt None: no prompt to check, as for `chat`)."""
    from mxserve.api.sampling_params import SamplingParams

    if prompt is not None and not prompt.strip():
        raise InvalidRequestError("prompt", "is empty")
    SamplingParams.from_defaults({}, **_sampling_fields(args))


def _sampling_params(args, llm):
    from mxserve.api.sampling_params import SamplingParams

    return SamplingParams.from_defaults(llm.engine.generation_defaults, **_sampling_fields(args))


def _llm(args):
    from mxserve.worker.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, quantization=args.quantization,
               quantize_lm_head=args.quantize_lm_head,
               tensor_parallel_size=args.tensor_parallel_size,
               speculative_config=args.speculative_config,
               **{k: getattr(args, k) for k in _EVICTION_FLAGS if getattr(args, k) is not None})


def cmd_draft_server(args) -> int:
    import threading

    from mxserve.worker.config import EngineConfig
    from mxserve.worker.draft_channel import DraftService
    from mxserve.worker.draft_server import DraftServer

    spec = dict(args.speculative_config or {"method": "eagle"}, draft_placement="local")
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len, quantization=args.quantization,
                          speculative_config=spec)
    service = DraftService(DraftServer(config, args.num_blocks), args.host, args.port)
    print(f"draft server listening on {service.address}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        service.close()
    return 0


def cmd_generate(args) -> int:
    _check_request(args.prompt, args)
    llm = _llm(args)
    params = _sampling_params(args, llm)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def cmd_chat(args) -> int:
    if args.endpoint:
        return _remote_chat(args)
    _check_request(None, args)
    llm = _llm(args)
    params = _sampling_params(args, llm)
    tokenizer = llm.tokenizer
    messages: list[dict[str, str]] = []
    print("mxserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while (line := _read_message()) is not None:
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        answer = _print_stream(llm.stream(tokenizer.encode(prompt, add_special_tokens=False),
                                          params))
        messages.append({"role": "assistant", "content": answer})
    return 0


def _read_message() -> str | None:
    """The user's next chat line; None when they quit (empty line, Ctrl-D or Ctrl-C)."""
    try:
        line = input("> ").strip()
    except (EOFError, KeyboardInterrupt):
        print(file=sys.stderr)
        return None
    return line or None


def _print_stream(texts) -> str:
    """Print text deltas as they come; Ctrl-C ends the answer (closing the stream aborts it)."""
    answer = ""
    try:
        for text in texts:
            print(text, end="", flush=True)
            answer += text
    except KeyboardInterrupt:
        texts.close()
    print()
    return answer


_EVICTION_FLAGS = ("kv_eviction", "kv_budget", "h2o_recent", "h2o_sinks")
_ENGINE_FLAGS = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "num_kv_blocks", "kv_cache_memory_gb", "num_threads", "tensor_parallel_size",
                 "speculative_config", *_EVICTION_FLAGS)


def cmd_serve(args) -> int:
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import serve_until_stopped

    flags = dict(model=args.model, model_name=args.model_name, num_workers=args.num_workers,
                 host=args.host, grpc_port=args.grpc_port, http_port=args.http_port,
                 metrics_port=args.metrics_port, max_queued_requests=args.max_queued_requests,
                 request_timeout_s=args.request_timeout_s, redis_url=args.redis_url,
                 route_prefix=args.route_prefix, app_name=args.app_name,
                 num_routers=args.num_routers, ingress=args.ingress)
    flags = {k: v for k, v in flags.items() if v is not None}
    config = ServeConfig.from_file(args.config) if args.config else ServeConfig()
    engine = {**config.engine, **{k: getattr(args, k) for k in _ENGINE_FLAGS
                                  if getattr(args, k) is not None}}
    resources = config.worker_resources.model_dump()
    if args.worker_cpus is not None:
        resources["num_cpus"] = args.worker_cpus
    if args.worker_gpus is not None:
        resources["num_gpus"] = args.worker_gpus
    routing = config.routing.model_dump()
    if args.routing:
        routing["policy"] = args.routing
    kv_transfer = config.kv_transfer.model_dump()
    if args.kv_transfer:
        kv_transfer["enabled"] = True
    drafts = config.drafts.model_dump()
    if args.draft_replicas is not None:
        drafts["num_replicas"] = args.draft_replicas
    for flag, key in ((args.draft_cpus, "num_cpus"), (args.draft_gpus, "num_gpus")):
        if flag is not None:
            drafts["resources"][key] = flag
    streaming = config.streaming.model_dump()
    for flag, key in ((args.streams_per_token, "streams_per_token"),
                      (args.max_tokens_per_message, "max_tokens_per_message"),
                      (args.direct_streams, "direct"), (args.request_intake, "intake")):
        if flag is not None:
            streaming[key] = flag
    config = ServeConfig(**{**config.model_dump(), **flags, "engine": engine,
                            "worker_resources": Resources(**resources), "routing": routing,
                            "drafts": drafts, "kv_transfer": kv_transfer,
                            "streaming": streaming})
    return serve_until_stopped(config, args.address, ask=args.ask)


def cmd_drain(args) -> int:
    import ray

    from mxserve.cluster.local import drain_worker

    ray.init(address=args.address, logging_level="WARNING")
    try:
        moved = drain_worker(args.app, args.worker)
    except LookupError as e:
        print(f"mxserve: error: {e}", file=sys.stderr)
        return 2
    print(f"worker {args.worker}: {moved} requests handed on; it takes no new ones")
    return 0


def cmd_client(args) -> int:
    from mxserve.cluster.client import Client

    _check_request(args.prompt, args)
    prompt = dict(messages=[{"role": "user", "content": args.prompt}]) if not args.completion \
        else dict(prompt=args.prompt)
    with Client(args.endpoint, args.app) as client:
        for chunk in client.stream(model=args.model, timeout_s=args.timeout, **prompt,
                                   **_sampling_fields(args)):
            print(chunk.text, end="", flush=True)
    print()
    return 0


def _remote_chat(args) -> int:
    from mxserve.cluster.client import Client

    messages: list[dict[str, str]] = []
    print(f"mxserve chat with {args.endpoint}: a message, an empty line or Ctrl-D to quit.",
          file=sys.stderr)
    with Client(args.endpoint, args.app) as client:
        while (line := _read_message()) is not None:
            messages.append({"role": "user", "content": line})
            chunks = client.stream(messages=messages, **_sampling_fields(args))
            answer = _print_stream(chunk.text for chunk in chunks)
            chunks.close()  # after a Ctrl-C: cancels the request on the server
            messages.append({"role": "assistant", "content": answer})
    return 0


def cmd_quantize(args) -> int:
    import os

    from mxserve.worker.model.quantize import quantize_checkpoint

    try:
        out = quantize_checkpoint(args.model, args.format, args.out, device=args.device,
                                  method=args.method, calibration=args.calibration,
                                  calibration_tokens=args.calibration_tokens)
    except (ValueError, OSError) as e:
        raise MxserveError(str(e)) from None
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(f"wrote {out} ({args.format}, {args.method}, {size / 2**20:.1f} MiB)")
    return 0


def cmd_train_draft(args) -> int:
    import json

    from mxserve.worker.eagle_train import TrainConfig, train_draft

    if min(args.num_prompts, args.epochs, args.max_tokens, args.batch_tokens,
           args.max_num_seqs, args.unroll_steps) < 1:
        raise MxserveError("--num-prompts, --epochs, --max-tokens, --batch-tokens, "
                           "--max-num-seqs and --unroll-steps must be >= 1")
    if args.draft_vocab_size < 0:
        raise MxserveError(f"--draft-vocab-size: must be >= 0, got {args.draft_vocab_size}")
    if not args.lr > 0:
        raise MxserveError(f"--lr: must be > 0, got {args.lr}")
    for flag, weight in (("--cls-weight", args.cls_weight),
                         ("--feature-weight", args.feature_weight)):
        if not weight >= 0:
            raise MxserveError(f"{flag}: must be >= 0, got {weight}")
    if args.cls_weight + args.feature_weight == 0:
        raise MxserveError("--cls-weight: it and --feature-weight are both 0 (nothing to learn)")
    if not 0 < args.cls_fraction <= 1:
        raise MxserveError(f"--cls-fraction: must be in (0, 1], got {args.cls_fraction}")
    if args.head_intermediate_size is not None and args.head_intermediate_size < 1:
        raise MxserveError(f"--head-intermediate-size: must be >= 1, got "
                           f"{args.head_intermediate_size}")
    if args.head_intermediate_size is not None and args.init_head:
        raise MxserveError("--head-intermediate-size: a head from --init-head keeps its own "
                           "width; give one or the other")
    report = train_draft(args.model, args.out, args.num_prompts, args.max_tokens,
                         args.heldout, args.num_speculative_tokens,
                         TrainConfig(epochs=args.epochs, lr=args.lr,
                                     batch_tokens=args.batch_tokens,
                                     unroll_steps=args.unroll_steps, seed=args.seed,
                                     cls_weight=args.cls_weight,
                                     feature_weight=args.feature_weight,
                                     cls_fraction=args.cls_fraction),
                         text_tokens=args.text_tokens, device=args.device,
                         init_head_dir=args.init_head,
                         head_intermediate_size=args.head_intermediate_size,
                         draft_vocab_size=args.draft_vocab_size,
                         max_num_seqs=args.max_num_seqs, num_threads=args.num_threads)
    print(json.dumps({key: report[key] for key in ("heldout_teacher_forced_top1", "heldout")
                      if key in report}))
    print(f"wrote {report['head']}: use speculative_config={{\"method\": \"eagle\", "
          f"\"model\": \"{report['head']}\"}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                "client": cmd_client, "quantize": cmd_quantize, "train-draft": cmd_train_draft,
                "draft-server": cmd_draft_server, "drain": cmd_drain}
    try:
        return commands[args.command](args)
    except MxserveError as e:
        print(f"mxserve: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        import grpc

        if isinstance(e, grpc.RpcError):
            print(f"mxserve: error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
