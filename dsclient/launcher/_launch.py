"""The one entry point: :func:`launch` plans one vLLM (a :class:`Server`) or, with
``replicas=N``, N of them (a :class:`ServerGroup`); neither starts before ``with`` /
:meth:`Server.start`. Use is shown in :mod:`dsclient.launcher`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import overload

from ._plan import plan_launch, wants_flag_check
from ._process import log_dir
from ._profiles import Hardware
from ._replicas import ServerGroup, launch_replicas
from ._server import Progress, Server

__all__ = ["launch"]

logger = logging.getLogger("dsclient")


@overload
def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = ...,
    max_model_len: int | None = ...,
    port: int | None = ...,
    profile: str | None = ...,
    host: str = ...,
    served_model_name: str | None = ...,
    dtype: str | None = ...,
    kv_cache_dtype: str | None = ...,
    block_size: int | None = ...,
    gpu_memory_utilization: float | None = ...,
    kv_cache_gib: int | None = ...,
    python: str | os.PathLike[str] | None = ...,
    hardware: Hardware | None = ...,
    extra_args: Sequence[str] = ...,
    dev_mode: bool = ...,
    check_flags: bool | None = ...,
    log_path: str | os.PathLike[str] | None = ...,
    startup_timeout: float = ...,
    progress: Progress | None = ...,
    replicas: None = ...,
    concurrent_start: bool | None = ...,
) -> Server: ...


@overload
def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = ...,
    max_model_len: int | None = ...,
    port: int | None = ...,
    profile: str | None = ...,
    host: str = ...,
    served_model_name: str | None = ...,
    dtype: str | None = ...,
    kv_cache_dtype: str | None = ...,
    block_size: int | None = ...,
    gpu_memory_utilization: float | None = ...,
    kv_cache_gib: int | None = ...,
    python: str | os.PathLike[str] | None = ...,
    hardware: Hardware | None = ...,
    extra_args: Sequence[str] = ...,
    dev_mode: bool = ...,
    check_flags: bool | None = ...,
    log_path: str | os.PathLike[str] | None = ...,
    startup_timeout: float = ...,
    progress: Progress | None = ...,
    replicas: int,
    concurrent_start: bool | None = ...,
) -> ServerGroup: ...


def launch(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    port: int | None = None,
    profile: str | None = None,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
    block_size: int | None = None,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: int | None = None,
    python: str | os.PathLike[str] | None = None,
    hardware: Hardware | None = None,
    extra_args: Sequence[str] = (),
    dev_mode: bool = False,
    check_flags: bool | None = None,
    log_path: str | os.PathLike[str] | None = None,
    startup_timeout: float = 300.0,
    progress: Progress | None = None,
    replicas: int | None = None,
    concurrent_start: bool | None = None,
) -> Server | ServerGroup:
    """Plan a vLLM server for ``model`` and return its (not yet started) :class:`Server`.

    ```python
    with launch(model_dir, max_num_seqs=8, served_model_name="tiny") as server:
        client = AsyncClient(server)
    ```

    The other parameters are those of :func:`plan_launch` (``profile``:
    ``latency-sensitive``, ``balanced`` (default) or ``throughput-first``; ``host`` defaults
    to loopback; without ``port``, 8000 when it is free, else a free one; ``dev_mode``
    defaults to off).

    ``replicas=N`` plans N servers of the model on this machine instead (each on its own port
    and share of the CPUs or GPUs) and returns them as one
    :class:`~dsclient.launcher.ServerGroup`, started and stopped together:

    ```python
    with launch(model_dir, served_model_name="tiny", replicas=2) as group:
        print(group.urls)
    ```

    They start all at once (measured faster than one after another, see
    :func:`dsclient.launcher._replicas.split_hardware`); ``concurrent_start=False`` starts them
    in turn.

    ``check_flags`` (default: when ``extra_args`` are given) runs vLLM's own parser on the
    planned command when the server starts, not here: the check imports vLLM (10 to 25 s), and
    ``launch()`` is often called inside an event loop. :meth:`Server.astart` runs it in a
    worker thread. A refusal raises :class:`VllmFlagsError` there, before any process starts.

    Parameters:
        log_path: where the server's output goes; default ``~/.cache/dsclient/logs/``.
        startup_timeout: seconds to wait for ``/health`` (vLLM on CPU takes about a minute).
        progress: called with a line of text while waiting (default: the ``dsclient`` logger).
    """
    if replicas is not None:
        return launch_replicas(
            model,
            replicas,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            port=port,
            profile=profile,
            host=host,
            served_model_name=served_model_name,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_gib=kv_cache_gib,
            python=python,
            hardware=hardware,
            extra_args=extra_args,
            dev_mode=dev_mode,
            check_flags=check_flags,
            concurrent_start=concurrent_start,
            log_path=log_path,
            startup_timeout=startup_timeout,
            progress=progress,
        )
    if concurrent_start is not None:
        raise ValueError("concurrent_start is for replicas=N; one server has nothing to overlap")
    plan = plan_launch(
        model,
        profile=profile,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        host=host,
        port=port,
        served_model_name=served_model_name,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_gib=kv_cache_gib,
        python=python,
        hardware=hardware,
        extra_args=extra_args,
        dev_mode=dev_mode,
        check_flags=False,  # at start: see above
    )
    for note in plan.notes:
        if not note.startswith("warning:"):  # plan_launch logged those as warnings
            logger.info("launch plan: %s", note)
    if log_path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        port_part = plan.url.rsplit(":", 1)[-1]
        log_path = log_dir() / f"vllm-{port_part}-{stamp}.log"
    return Server(
        plan,
        log_path=Path(log_path).expanduser(),
        startup_timeout=startup_timeout,
        progress=progress,
        check_flags=wants_flag_check(check_flags, extra_args),
    )
