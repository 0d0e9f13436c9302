"""Which ports a launch listens on: ``vllm serve``'s own 8000 when it is free, else free ones
the system hands out; for N replicas, N of them (:func:`choose_ports`, pure: the checks are
passed in).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from ._errors import LaunchError

__all__ = ["DEFAULT_PORT", "choose_port", "choose_ports", "free_ports", "port_is_free"]

#: The port a launch takes when none is given and it is free: ``vllm serve``'s own default.
DEFAULT_PORT = 8000


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (a socket in TIME_WAIT does not count)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct free ports: the sockets stay bound until all are chosen."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(_family(host), socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
    return ports


def choose_port(host: str) -> tuple[int, str | None]:
    """The port for a launch that names none, and a note when it is not :data:`DEFAULT_PORT`.

    ``vllm serve``'s own default (8000) when nothing holds it on ``host``, so the usual
    ``http://127.0.0.1:8000`` works as written; else a free port from the system.
    """
    if port_is_free(host, DEFAULT_PORT):
        return DEFAULT_PORT, None
    port = free_ports(host, 1)[0]
    return port, f"port {DEFAULT_PORT} is in use on {host}: using {port} (--port / port= to choose)"


def choose_ports(
    replicas: int,
    port: int | None,
    *,
    is_free: Callable[[int], bool],
    free_ports: Callable[[int], list[int]],
) -> tuple[list[int], str | None]:
    """The ports of ``replicas`` servers, and a note when they are not the asked ones.

    ``port`` given: ``port, port + 1, ...``, each of which must be free (else
    :class:`LaunchError` naming the busy ones). ``None``: 8000, 8001, ... when all are free,
    else ``free_ports(replicas)`` (distinct ports the system hands out).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas!r}")
    if port is not None:
        last = port + replicas - 1
        if port < 1 or last > 65535:
            raise LaunchError(
                f"{replicas} replicas from port {port} need ports {port}-{last}; ports end at"
                " 65535. Pass a lower port, or none"
            )
        wanted = list(range(port, last + 1))
        busy = [p for p in wanted if not is_free(p)]
        if busy:
            raise LaunchError(
                f"ports {', '.join(map(str, busy))} of {port}-{last} are already in use; pass"
                " another port, or none to get free ones"
            )
        return wanted, None
    default = list(range(DEFAULT_PORT, DEFAULT_PORT + replicas))
    if all(is_free(p) for p in default):
        return default, None
    ports = free_ports(replicas)
    if len(set(ports)) < replicas:
        raise LaunchError(f"could not find {replicas} free ports")
    return ports, (
        f"ports {DEFAULT_PORT}-{default[-1]} are not all free: using {', '.join(map(str, ports))}"
    )
