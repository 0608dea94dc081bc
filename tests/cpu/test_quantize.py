"""`mxserve quantize` and MX linears in the model (worker/model/quantize.py, mx_layers.py).

A quantized directory must hold the canonical packed bytes, load through open_checkpoint, and serve
exactly the model whose decoder linears are dequantize(quantize(w)) (computed here with the
kernels' torch references); quantizing while loading (`quantization=`) must give the same model.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mxserve import LLM, SamplingParams
from mxserve.api.errors import ModelLoadError
from mxserve.cluster import cli
from mxserve.kernels.mx import MXTensor, dequantize_mx_torch, get_format, quantize_mx_torch
from mxserve.worker.config import MX_QUANTIZATIONS, EngineConfig
from mxserve.worker.model import mx_layers
from mxserve.worker.model.checkpoint import TensorSlice, expected_tensor_names
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.parallel import ColumnParallelLinear, RowParallelLinear
from mxserve.worker.model.quantize import quantize_checkpoint
from mxserve.worker.model.tp import TPGroup

ARCHS = {"llama": ("llama", {}), "qwen2-bias": ("qwen2", {})}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 42, 9], list(range(3, 40)), [200, 100, 50, 25, 12, 6, 3]]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sources(tiny_checkpoint):
    return {name: str(tiny_checkpoint(arch, **kw)) for name, (arch, kw) in ARCHS.items()}


@pytest.fixture(scope="module")
def quantized(sources, tmp_path_factory):
    """quantized(arch, fmt) -> the directory quantize_checkpoint wrote (made once)."""
    made: dict[tuple[str, str], str] = {}

    def get(arch: str, fmt: str) -> str:
        if (arch, fmt) not in made:
            out = str(tmp_path_factory.mktemp(f"{arch}-{fmt}"))
            made[arch, fmt] = quantize_checkpoint(sources[arch], fmt, out, progress=False)
        return made[arch, fmt]
    return get


def _round_trip_dir(src: str, fmt: str, out, head: bool = False) -> str:
    """A float checkpoint whose decoder linears (and with `head` its LM head: a tied one untied,
    the embedding kept) are dequantize(quantize(w)): the reference."""
    shutil.copytree(src, out)
    tensors = load_file(f"{src}/model.safetensors")
    round_trip = lambda w: dequantize_mx_torch(  # noqa: E731
        quantize_mx_torch(w, MX_QUANTIZATIONS[fmt], mx_layers.SCALE_MODE), w.dtype)
    for name, w in tensors.items():
        if mx_layers.is_mx_linear(name):
            tensors[name] = round_trip(w)
    if head:
        tensors["lm_head.weight"] = round_trip(tensors.get("lm_head.weight",
                                                           tensors["model.embed_tokens.weight"]))
        with open(f"{out}/config.json") as f:
            config = json.load(f)
        with open(f"{out}/config.json", "w") as f:
            json.dump({**config, "tie_word_embeddings": False}, f)
    save_file(tensors, f"{out}/model.safetensors", metadata={"format": "pt"})
    return str(out)


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """From now on, the logits of every sampled row, in step order."""
    records, execute = [], llm.engine.runner.execute

    def recording(plan):
        result = execute(plan)
        records.extend(result.logits.clone())
        return result

    llm.engine.runner.execute = recording
    return records


def _run(model: str, **options) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of PROMPTS and the logits of every sampled row, in step order."""
    llm = LLM(model=model, dtype="float32", max_num_batched_tokens=16, num_kv_blocks=32,
              load_progress=False, **options)
    records = _record_logits(llm)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)], records


def _ask_france(llm: LLM):
    """The greedy answer, and the log-probabilities of its first token."""
    records = _record_logits(llm)
    answer = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=32))[0]
    return answer, records[0].log_softmax(-1)


def _assert_same(a, b, atol: float = 1e-5) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    assert len(a[1]) == len(b[1])
    worst = max((x - y).abs().max().item() for x, y in zip(a[1], b[1]))
    assert worst <= atol, f"max |logit difference| {worst:.2e}"


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_quantized_dir_holds_packed_weights_and_loads(sources, quantized, arch, fmt):
    out, elem = quantized(arch, fmt), MX_QUANTIZATIONS[fmt]
    source = load_file(f"{sources[arch]}/model.safetensors")
    with safe_open(f"{out}/model.safetensors", framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    for name, w in source.items():
        if not mx_layers.is_mx_linear(name):
            assert stored[name].dtype == w.dtype and torch.equal(stored[name], w), name
            continue
        (n, k), want = w.shape, quantize_mx_torch(w, elem, mx_layers.SCALE_MODE)
        assert name not in stored
        assert stored[name + "_mx"].dtype == stored[name + "_scale"].dtype == torch.uint8
        assert stored[name + "_mx"].shape == (n, get_format(elem).packed_len(k))
        assert stored[name + "_scale"].shape == (n, k // 32)
        assert torch.equal(stored[name + "_mx"], want.data), name
        assert torch.equal(stored[name + "_scale"], want.scales), name
    with open(f"{out}/config.json") as f:
        qc = json.load(f)["quantization_config"]
    assert qc == {"quant_method": "mx", "format": fmt, "elem_format": elem, "block_size": 32,
                  "scale_mode": "ceil", "method": "rtn", "modules": list(mx_layers.MX_MODULES)}
    ckpt = open_checkpoint(out)
    assert ckpt.quantization == fmt
    weights = dict(ckpt.weights(progress=False))
    assert list(weights) == expected_tensor_names(ckpt.config)
    q = weights["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(q, MXTensor) and q.fmt == elem
    assert q.shape == tuple(source["model.layers.1.mlp.down_proj.weight"].shape)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp6"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_served_model_equals_round_trip_reference_and_on_the_fly(sources, quantized, tmp_path,
                                                                 arch, fmt):
    reference = _run(_round_trip_dir(sources[arch], fmt, tmp_path / "ref"))
    from_dir = _run(quantized(arch, fmt))
    _assert_same(from_dir, reference)
    _assert_same(_run(sources[arch], quantization=fmt), from_dir)
    assert from_dir[0] != _run(sources[arch])[0]  # the quantization did change the model


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head_serves_the_round_tripped_head(tiny_checkpoint, tmp_path, monkeypatch,
                                                       tied):
    """quantize_lm_head: the LM head too is dequantize(quantize(w)), a tied model's embedding
    stays as it was; from a float checkpoint and from an `mxserve quantize` one alike, and in
    the packed form a GPU keeps (mx_linear, here its reference)."""
    src = str(tiny_checkpoint("llama", tie_word_embeddings=tied))
    reference = _run(_round_trip_dir(src, "mxfp4", tmp_path / "ref", head=True))
    on_the_fly = _run(src, quantization="mxfp4", quantize_lm_head=True)
    _assert_same(on_the_fly, reference)
    from_dir = quantize_checkpoint(src, "mxfp4", str(tmp_path / "q"), progress=False)
    _assert_same(_run(from_dir, quantize_lm_head=True), reference)
    head_kept = _run(src, quantization="mxfp4")
    worst = max((x - y).abs().max().item() for x, y in zip(head_kept[1], on_the_fly[1]))
    assert worst > 1e-2  # the head's quantization did change the logits
    monkeypatch.setattr(mx_layers, "packed_on", lambda device: True)
    _assert_same(_run(src, quantization="mxfp4", quantize_lm_head=True), reference)


def test_packed_form_matches_the_dequantized_form(sources, quantized, monkeypatch):
    """What a GPU keeps (packed weights, mx_linear) on CPU, where mx_linear is its reference."""
    out = quantized("qwen2-bias", "mxfp6")
    dense = _run(out)
    monkeypatch.setattr(mx_layers, "packed_on", lambda device: True)
    _assert_same(_run(out), dense)
    _assert_same(_run(sources["qwen2-bias"], quantization="mxfp6"), dense)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_of_mx_weights(monkeypatch, rank, packed):
    """Fused column-parallel rows and row-parallel 32-blocks of K, from MX and float weights."""
    monkeypatch.setattr(mx_layers, "packed_on", lambda device: packed)
    gen = torch.Generator().manual_seed(rank)
    tp, sizes, k = TPGroup(rank, 2), [64, 32, 32], 128
    fused = [torch.randn(n, k, generator=gen) for n in sizes]  # q, k, v
    down = torch.randn(48, k, generator=gen)
    x = torch.randn(3, k, generator=gen)
    x_local = x.chunk(2, 1)[rank]
    mode = mx_layers.SCALE_MODE
    round_trip = lambda w: dequantize_mx_torch(quantize_mx_torch(w, "e2m1", mode))  # noqa: E731
    rows = lambda n: TensorSlice(0, *tp.split(n))  # noqa: E731
    columns = TensorSlice(1, *tp.split(k))
    for as_mx in (True, False):  # an MX checkpoint (sliced as MX), and quantizing a float slice
        def load(w, part, as_mx=as_mx):
            if as_mx:
                return mx_layers.slice_mx(quantize_mx_torch(w, "e2m1", mode), part)
            return part.take(w)

        col = ColumnParallelLinear(k, [n // 2 for n in sizes], False, tp, torch.float32,
                                   quant="e2m1")
        for i, w in enumerate(fused):
            col.load(i, load(w, rows(w.shape[0])))
        col.finish_loading()
        want = torch.cat([round_trip(w).chunk(2, 0)[rank] for w in fused])
        torch.testing.assert_close(col(x), x @ want.T, atol=1e-5, rtol=0)
        row = RowParallelLinear(k, 48, tp, torch.float32, quant="e2m1")
        row.load(load(down, columns))
        row.finish_loading()
        want = round_trip(down).chunk(2, 1)[rank]
        torch.testing.assert_close(row.weight(x_local), x_local @ want.T, atol=1e-5, rtol=0)
    with pytest.raises(ModelLoadError, match="multiple of 32"):
        RowParallelLinear(64, 8, TPGroup(rank, 4), torch.float32, quant="e2m1")  # K 16 a rank


def test_bad_formats_and_shapes_are_clear_errors(sources, quantized, tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="'mxfp5'"):
        quantize_checkpoint(sources["llama"], "mxfp5", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantize_lm_head needs an MX model"):
        LLM(model=sources["llama"], quantize_lm_head=True, load_progress=False)
    odd = str(tiny_checkpoint("llama", intermediate_size=80))  # down_proj K = 80
    with pytest.raises(ModelLoadError, match=r"mlp\.down_proj\.weight.*K=80"):
        quantize_checkpoint(odd, "mxfp4", str(tmp_path / "b"))
    with pytest.raises(ModelLoadError, match=r"mlp\.down_proj\.weight.*K=80"):
        LLM(model=odd, quantization="mxfp4", load_progress=False)
    mx4 = quantized("llama", "mxfp4")
    with pytest.raises(ModelLoadError, match="mxfp4 already"):
        LLM(model=mx4, quantization="mxfp6", load_progress=False)
    with pytest.raises(ValueError, match="MX-quantized already"):
        quantize_checkpoint(mx4, "mxfp6", str(tmp_path / "c"))
    with pytest.raises(ValueError, match="not empty"):
        quantize_checkpoint(sources["llama"], "mxfp4", mx4)


def test_broken_mx_checkpoints_fail_at_open(quantized, tmp_path):
    bad = shutil.copytree(quantized("llama", "mxfp4"), tmp_path / "bad")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="k_proj.weight_scale"):
        open_checkpoint(str(bad))
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="'gptq'"):
        open_checkpoint(str(bad))


def test_command_line(sources, tmp_path, capsys):
    out = str(tmp_path / "q")
    umask = os.umask(0o022)
    assert cli.main(["quantize", "--model", sources["llama"], "--format", "mxfp6_e3m2",
                          "--out", out]) == 0
    assert "wrote" in capsys.readouterr().out
    assert open_checkpoint(out).quantization == "mxfp6_e3m2"
    os.umask(umask)
    for name in os.listdir(out):  # the permissions any written file gets, not private ones
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o644, name
    assert cli.main(["quantize", "--model", sources["llama"], "--format", "mxfp4",
                     "--out", out]) == 2
    assert "not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--format", "mxfp5", "--out", out])


@pytest.mark.slow
def test_smollm2_quantized_end_to_end(tmp_path):
    """The GGUF default model: tokenizer and config survive the trip, mxfp4 answers "Paris", and
    mxfp6's first-token distribution is the closer to the source's."""
    source = LLM(load_progress=False)
    _, first = _ask_france(source)
    kl = {}
    for fmt in ("mxfp6", "mxfp4"):
        out = quantize_checkpoint(None, fmt, str(tmp_path / fmt), progress=False)
        llm = LLM(model=out, load_progress=False)
        prompt = llm.tokenizer.apply_chat_template(FRANCE)
        assert prompt == source.tokenizer.apply_chat_template(FRANCE)
        assert llm.tokenizer.encode(prompt) == source.tokenizer.encode(prompt)
        assert llm.engine.model_config.eos_token_ids == source.engine.model_config.eos_token_ids
        answer, logprobs = _ask_france(llm)
        kl[fmt] = torch.sum(first.exp() * (first - logprobs)).item()
        if fmt == "mxfp4":
            assert "Paris" in answer.text and answer.finish_reason == "stop"
    # Not asserted: mxfp6 (e2m3) answering "Paris". The source's first token is a near tie
    # ("The" p=0.15, "L" 0.14, "La" 0.10) and e2m3 tips it to "La", then answers in French.
    assert kl["mxfp6"] < kl["mxfp4"]
