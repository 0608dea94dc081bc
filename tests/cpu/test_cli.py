"""The `mxserve` command as a user runs it, on the real SmolLM2 model."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from mxserve.cluster.redis_server import free_port

CLI = [sys.executable, "-m", "mxserve.cluster.cli"]


def test_help_loads_no_torch_triton_or_ray():
    """The parser and every subcommand's --help import nothing heavy, so they answer at once."""
    code = ("import sys\nfrom mxserve.cluster import cli\n"
            "for argv in (['--help'], ['serve', '--help'], ['generate', '--help'],\n"
            "             ['client', '--help'], ['chat', '--help'], ['quantize', '--help']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as e:\n"
            "        assert e.code == 0, argv\n"
            "print('LOADED', sorted(m for m in ('torch', 'triton', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: mxserve serve" in done.stdout and "--metrics-port" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "LOADED []"


def test_bad_input_fails_before_any_work():
    """An empty prompt or a bad flag is refused before a model loads or a server is called:
    the model path and the endpoint here do not exist, and the error is about the input."""
    for argv in (["generate", "", "--model", "/nonexistent/model"],
                 ["generate", "hi", "--temperature", "-1", "--model", "/nonexistent/model"],
                 ["client", "  ", "--endpoint", f"127.0.0.1:{free_port()}"]):
        done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        field = "temperature" if "-1" in argv else "prompt"
        assert done.stderr.startswith(f"mxserve: error: {field}: "), (argv, done.stderr)


def test_train_draft_refuses_bad_loss_flags_before_loading_the_model(tmp_path):
    for flag, value in (("--cls-fraction", "0"), ("--cls-fraction", "1.5"),
                        ("--feature-weight", "-1"), ("--head-intermediate-size", "0"),
                        ("--head-intermediate-size", "64 --init-head /some/head")):
        argv = ["train-draft", "--out", str(tmp_path), "--model", "/nonexistent/model",
                flag, *value.split()]
        done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.startswith(f"mxserve: error: {flag}"), (argv, done.stderr)


def test_generate_answers_with_paris():
    """The README's offline command, with the model's default sampling."""
    done = subprocess.run([*CLI, "generate", "--chat", "What is the capital of France?"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris."


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
                           "--metrics-port", str(free_port()), "--num-threads", "1"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    port = int(re.search(r"prefix-aware routing, index at redis://127.0.0.1:(\d+)/",
                         done.stdout).group(1))
    with socket.socket() as s:  # the local redis-server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_serve_refuses_a_port_in_use():
    """A second `mxserve serve` on a port another server holds fails at once, naming it (the
    routers share their ports with each other, so it must not join another's)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([*CLI, "serve", "--grpc-port", str(free_port()), "--http-port",
                               str(port), "--metrics-port", str(free_port())],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"mxserve: error: http_port {port} on 127.0.0.1 is in use" in done.stderr
    assert "--http-port" in done.stderr and "Traceback" not in done.stderr


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


def _listen_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_first_run_of_serve_looks_finished():
    """`mxserve serve` as a new user meets it: loading shows progress, one ready line names the
    gRPC and metrics endpoints, gRPC listens on loopback only, the metrics URL serves mxserve's
    series, each request the client got wrong is one log line (no traceback, no ERROR), and a
    terminal's Ctrl-C (SIGINT to the whole process group) stops everything quietly."""
    import grpc

    from mxserve.cluster.client import Client

    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # as a user's shell has them: unset
        env.pop(key, None)
    proc = subprocess.Popen([*CLI, "serve", "--grpc-port", str(grpc_port), "--http-port",
                             str(http_port), "--metrics-port", str(metrics_port),
                             "--num-threads", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        ready = ""
        for line in proc.stdout:
            if line.startswith("mxserve: ready:"):
                ready = line
                break
        assert ready, proc.stderr.read()[-3000:]
        assert f"gRPC 127.0.0.1:{grpc_port}" in ready
        base_url = f"http://127.0.0.1:{http_port}/v1"
        assert f"OpenAI API {base_url};" in ready
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        assert metrics_url in ready
        # 127.0.0.1 (in IPv4 or IPv4-mapped IPv6 form), no other interface
        assert _listen_addresses(grpc_port) <= {"0100007F", "0000000000000000FFFF00000100007F"}
        assert _listen_addresses(grpc_port)
        assert _listen_addresses(http_port) <= {"0100007F", "0000000000000000FFFF00000100007F"}
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = _post(base_url + "/chat/completions", {"messages": question, "temperature": 0})
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
        bad = _post(base_url + "/completions", {"prompt": "hi", "temperature": -1})
        assert bad["error"]["param"] == "temperature", bad
        with Client(f"127.0.0.1:{grpc_port}") as client:
            for bad in (dict(prompt="hi", temperature=-1), dict(prompt="")):
                try:
                    client.generate(**bad)
                    raise AssertionError(f"{bad} was accepted")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            stream = client.stream("hi", max_tokens=200, ignore_eos=True)
            next(stream)
            stream.close()  # a cancel
            assert client.generate("The capital of France is", max_tokens=4).completion_tokens
        deadline = time.monotonic() + 40
        while "ray_mxserve_" not in (text := _get(metrics_url)):
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(1)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert re.search(r"worker \w+: loading SmolLM2-135M-Instruct", err)
    assert re.search(r"loading SmolLM2-135M-Instruct.Q4_1.gguf: 100%", err)
    assert re.search(r"worker \w+: ready in [\d.]+ s \(cpu, ", err)
    assert len(re.findall(r"INVALID_ARGUMENT: temperature: must be", err)) == 2, err  # +HTTP
    assert len(re.findall(r"INVALID_ARGUMENT: prompt: is empty", err)) == 1, err
    assert len(re.findall(r"request mx-\w+: cancelled", err)) == 1, err
    for noise in ("Traceback", "ERROR", "Token authentication", "graceful_shutdown",
                  "could not leave the prefix index", "is ready at http"):
        assert noise not in err + out, (noise, err[-3000:])
    assert not _listen_addresses(grpc_port)


def _post(url: str, body: dict) -> dict:
    """OpenAI's JSON reply, or its error body."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def _get(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.read().decode()
    except OSError:
        return ""
