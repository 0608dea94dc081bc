"""The `mxserve` command as a user runs it, on the real SmolLM2 model."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-m", "mxserve.cluster.cli"]


def test_generate_answers_with_paris():
    done = subprocess.run([*CLI, "generate", "--chat", "What is the capital of France?",
                           "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_chat_streams_answers_and_quits_on_empty_line():
    done = subprocess.run([*CLI, "chat", "--max-tokens", "24"], capture_output=True, text=True,
                          input="What is the capital of France?\n\n", timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout


def test_bad_model_path_is_a_clear_error():
    done = subprocess.run([*CLI, "generate", "hi", "--model", "/nonexistent/model"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "mxserve: error:" in done.stderr and "/nonexistent/model" in done.stderr


def test_quantize_then_generate_from_the_quantized_directory(tmp_path):
    out = tmp_path / "smollm2-mxfp4"
    done = subprocess.run([*CLI, "quantize", "--format", "mxfp4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    done = subprocess.run([*CLI, "generate", "--chat", "What is the capital of France?",
                           "--model", str(out), "--max-tokens", "24"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
