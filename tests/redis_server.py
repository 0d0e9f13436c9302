"""A real ``redis-server`` for tests: started on a free loopback port, stopped at the end.

    with RedisServer() as redis:          # picks a free port on 127.0.0.1
        url = redis.url                   # "redis://127.0.0.1:PORT/0"
        redis.stop(); redis.start()       # a restart keeps the port (the data is gone)

Nothing is written to disk (``--save '' --appendonly no``): a restart is an empty Redis, which is
what a crashed and restarted cache looks like to the clients. ``.ci/run`` installs Debian's
``redis-server``; without it on PATH :class:`RedisServer` raises a :class:`RuntimeError` that
says so (the fixtures in ``tests/conftest.py`` turn it into a test failure, never a skip).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from types import TracebackType


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(port: int, timeout: float = 0.5) -> bool:
    # RESP by hand: no redis-py needed to know the server is up.
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1; a context manager; restartable on its port.

    Parameters:
        port: the port (a free one when ``None``).
        password: set ``requirepass`` (the URL then carries it, as ``redis://:PW@host:port/0``).
        start_timeout: seconds to wait for the first PING answer.
    """

    def __init__(
        self, port: int | None = None, *, password: str | None = None, start_timeout: float = 10.0
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not on PATH: install Debian's 'redis-server' package "
                "(.ci/run does: apt-get update && apt-get install -y redis-server)"
            )
        self.binary = binary
        self.port = port if port is not None else free_port()
        self.password = password
        self.start_timeout = start_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The Redis URL of database 0, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server (on the same port as before) and wait until it answers PING."""
        if self.running:
            return
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self._proc = None
                raise RuntimeError(
                    f"redis-server on port {self.port} exited at start: {err[-500:]}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in time")

    def _answers(self) -> bool:
        if not self.password:
            return _ping(self.port)
        # With requirepass an unauthenticated PING answers -NOAUTH: the server is up all the same.
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64)[:1] in (b"+", b"-")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and wait until the port is closed."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def kill(self) -> None:
        """Kill the server with SIGKILL (a crash, not a shutdown)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
