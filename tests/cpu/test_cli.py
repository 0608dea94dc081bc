"""The `mxserve` command as a user runs it, on the real SmolLM2 model."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

from mxserve.cluster.redis_server import free_port

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


def test_serve_ask_is_the_main_job_and_cleans_up():
    """The README's main command: a local Ray cluster with a local redis-server serves SmolLM2,
    one real gRPC request gets "Paris", and everything (Ray, Redis) is gone afterwards."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([*CLI, "serve", "--ask", "What is the capital of France?",
                           "--grpc-port", str(free_port()), "--http-port", str(free_port()),
                           "--num-threads", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    port = int(re.search(r"prefix-aware routing, index at redis://127.0.0.1:(\d+)/",
                         done.stdout).group(1))
    with socket.socket() as s:  # the local redis-server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


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
