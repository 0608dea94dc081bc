"""The `mxserve` command: generate, chat (and, later, serve and client)."""

from __future__ import annotations

import argparse
import sys

from mxserve.worker.errors import MxserveError


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file, or 'smollm2' (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    chat = sub.add_parser("chat", help="interactive chat with streamed answers")
    for p in (gen, chat):
        _engine_args(p)
        _sampling_args(p)
    return parser


def _sampling_params(args):
    from mxserve.worker.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)


def _llm(args):
    from mxserve.worker.llm import LLM

    return LLM(model=args.model, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len)


def cmd_generate(args) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate(args.prompt, params)[0]
    print(out.text)
    return 0


def cmd_chat(args) -> int:
    params = _sampling_params(args)
    llm = _llm(args)
    engine, tokenizer = llm.engine, llm.tokenizer
    messages: list[dict[str, str]] = []
    print("mxserve chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            return 0
        messages.append({"role": "user", "content": line})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rid = engine.add_request(tokenizer.encode(prompt, add_special_tokens=False), params)
        answer = _stream(engine, rid)
        messages.append({"role": "assistant", "content": answer})


def _stream(engine, request_id: str) -> str:
    text = ""
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    print(out.new_text, end="", flush=True)
                    text += out.new_text
    except KeyboardInterrupt:
        engine.abort(request_id)
    print()
    return text


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "chat": cmd_chat}[args.command](args)
    except MxserveError as e:
        print(f"mxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
