"""Tokenizers for the checkpoints mxserve loads, and incremental detokenization for streaming.

A `Tokenizer` wraps a Hugging Face `tokenizers.Tokenizer` (the fast Rust backend) and adds what the
serving path needs around it: the BOS rule, the stop ids and the chat template. It is built either
from a Hugging Face directory (`tokenizer.json` + `tokenizer_config.json`) or from a GGUF file's
metadata, which holds no `tokenizer.json`: the byte-level BPE is rebuilt from the vocabulary, the
merges and the token types, with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from mxserve.api.errors import InvalidRequestError, ModelLoadError

# Used when a checkpoint has no chat template: one "role: content" line per message, then
# "assistant:" when a generation prompt is asked for. No model is trained on it; it only keeps
# chat requests working for base models.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

# llama.cpp's split regexes (llama-vocab.cpp), by `tokenizer.ggml.pre`. "smollm" and the other
# StarCoder-family vocabularies first isolate every digit, then apply the GPT-2 regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_REGEX_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The decoded value of GGUF metadata `key` (str, number, bool or list), or `default`."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    `encode` prepends BOS only when `add_special_tokens` is true and the checkpoint asks for it
    (`add_bos_token`); it never appends EOS. Special tokens written in the text (e.g.
    "<|im_start|>") are matched whole. A prompt rendered by a template that already writes the BOS
    token should be encoded with `add_special_tokens=False`.
    """

    def __init__(self, backend: _Backend, *, bos_token: str | None, eos_tokens: Sequence[str],
                 add_bos_token: bool, chat_template: str | None) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_tokens = tuple(eos_tokens)
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_ids = (backend.token_to_id(t) for t in self.eos_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(i for i in eos_ids if i is not None))
        try:
            self._template = _jinja_env().from_string(chat_template or FALLBACK_CHAT_TEMPLATE)
        except jinja2.TemplateError as e:
            raise ModelLoadError(f"chat template does not compile: {e}") from e

    # ---- construction ----

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (which wins over
        the config's template). Raises ModelLoadError naming a missing or unreadable file."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError(f"{tok_file}: missing (mxserve needs a fast tokenizer.json)")
        try:
            backend = _Backend.from_file(tok_file)
        except Exception as e:
            raise ModelLoadError(f"{tok_file}: cannot be read: {e}") from e
        cfg = read_json(os.path.join(path, "tokenizer_config.json"))
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no flag: do what the backend's post-processor would do
            bos_id = backend.token_to_id(bos) if bos else None
            add_bos = bos_id is not None and backend.encode("").ids[:1] == [bos_id]
        return cls(backend, bos_token=bos, eos_tokens=[eos] if eos else [],
                   add_bos_token=bool(add_bos), chat_template=_hf_chat_template(path, cfg))

    @classmethod
    def from_gguf(cls, reader: Any) -> Tokenizer:
        """Rebuild the byte-level BPE (`tokenizer.ggml.model` "gpt2") a GGUF file describes.

        Control tokens (type 3) become special added tokens, user-defined ones (type 4) plain added
        tokens; EOS ids are `eos_token_id` plus `eot_token_id`/`eom_token_id` when present."""
        kind = gguf_field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"GGUF tokenizer.ggml.model {kind!r} is not supported (only gpt2)")
        tokens = gguf_field(reader, "tokenizer.ggml.tokens")
        merges = gguf_field(reader, "tokenizer.ggml.merges", [])
        types = gguf_field(reader, "tokenizer.ggml.token_type", [])
        backend = _byte_level_bpe(tokens, merges, gguf_field(reader, "tokenizer.ggml.pre", "gpt2"))
        _add_gguf_tokens(backend, tokens, types)

        def token(key: str) -> str | None:
            token_id = gguf_field(reader, f"tokenizer.ggml.{key}")
            return tokens[token_id] if token_id is not None and token_id < len(tokens) else None

        eos = [t for key in ("eos", "eot", "eom") if (t := token(f"{key}_token_id"))]
        return cls(backend, bos_token=token("bos_token_id"), eos_tokens=eos,
                   add_bos_token=bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", False)),
                   chat_template=gguf_field(reader, "tokenizer.chat_template"))

    # ---- use ----

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (added tokens included)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of every special added token plus BOS and EOS (what skip_special_tokens drops)."""
        ids = [i for i, t in self._backend.get_added_tokens_decoder().items() if t.special]
        ids += [self.bos_token_id] if self.bos_token_id is not None else []
        return tuple(sorted(set(ids + list(self.eos_token_ids))))

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return self._bos(add_special_tokens) + ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of each text, run in parallel by the backend."""
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [self._bos(add_special_tokens) + e.ids for e in encodings]

    def _bos(self, add_special_tokens: bool) -> list[int]:
        wanted = add_special_tokens and self.add_bos_token and self.bos_token_id is not None
        return [self.bos_token_id] if wanted else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's template (or
        FALLBACK_CHAT_TEMPLATE). A template's raise_exception -> InvalidRequestError("messages")."""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_tokens[0] if self.eos_tokens else "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError("messages", f"chat template rejected them: {e}") from e


class IncrementalDetokenizer:
    """Turns a stream of output ids into text deltas.

    Contract: "".join(step(...) for each batch) + flush() == tokenizer.decode(all output ids).
    A delta never ends in an incomplete UTF-8 character: text ending in U+FFFD is held back until
    the next ids complete it (or `flush` at the end of the request). Each step decodes only a short
    window, from the previous emission point on. The text is that of the output alone (`prompt_ids`
    is only recorded), so streamed and non-streamed responses agree character for character.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.num_prompt_tokens = len(prompt_ids)
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self._prefix = 0  # decode windows start here: an id already emitted, or 0
        self._read = 0  # ids before this index have been emitted as text

    def step(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the text they complete ("" when it is held back). Several
        ids decode as one window, unless they end inside a character: then id by id, so the
        complete characters before it go now, as steps of one id each would send them."""
        self.output_ids.extend(new_ids)
        prefix_text = self._decode(self.output_ids[self._prefix:self._read])
        text = self._decode(self.output_ids[self._prefix:])
        if text.endswith("\ufffd") and len(new_ids) > 1:
            del self.output_ids[-len(new_ids):]
            return "".join(self.step([i]) for i in new_ids)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self.output_ids)
        return text[len(prefix_text):]

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character at the end shows as U+FFFD)."""
        prefix_text = self._decode(self.output_ids[self._prefix:self._read])
        text = self._decode(self.output_ids[self._prefix:])
        self._prefix = self._read = len(self.output_ids)
        return text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens) if ids else ""


# ---- helpers ----


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def read_json(path: str, required: bool = False) -> dict:
    """A checkpoint's JSON file; {} when absent (ModelLoadError if `required`) or not valid."""
    if not os.path.isfile(path):
        if required:
            raise ModelLoadError(f"{path}: missing")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from e


def _token_str(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _hf_chat_template(path: str, cfg: dict) -> str | None:
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    template = cfg.get("chat_template") or read_json(
        os.path.join(path, "chat_template.json")).get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return table


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> _Backend:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    backend = _Backend(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splitting for `tokenizer.ggml.pre`; unknown names get GPT-2's regex."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level


def _add_gguf_tokens(backend: _Backend, tokens: list[str], types: list[int]) -> None:
    """Control tokens -> special, user-defined -> plain added tokens, both matched whole. A
    control token spelled outside the byte alphabet is a converter mislabel and is skipped."""
    alphabet = set(_bytes_to_unicode().values())
    vocab = backend.get_vocab()
    control = [t for t, k in zip(tokens, types, strict=False)
               if k == _GGUF_CONTROL and set(t) <= alphabet]
    user = [t for t, k in zip(tokens, types, strict=False)
            if k == _GGUF_USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
