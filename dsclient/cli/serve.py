"""``dsclient serve``: start a vLLM server (or N replicas) with the launcher."""

from __future__ import annotations

import argparse
import json
import signal
import types
from typing import Any

from ._common import err as _err


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ..launcher import DEFAULT_PROFILE, PROFILES

    p = sub.add_parser(
        "serve",
        help="start a reference vLLM server (foreground; Ctrl-C stops it)",
        description=(
            "Start vLLM for MODEL as a child process bound to loopback, wait for /health, and"
            " record its max_num_seqs so dsclient clients know it. Ctrl-C stops it and all its"
            " engine processes. Flags after '--' go to vLLM unchanged, once the installed"
            " vLLM's own argument parser has accepted them (--dry-run included; the check"
            " imports vLLM, 10-25 s)."
        ),
        epilog=(
            "examples:\n"
            "  dsclient serve ~/.cache/dsclient/models/tiny-llama --max-num-seqs 8\n"
            "  dsclient serve MODEL --profile latency-sensitive --dry-run\n"
            "  dsclient serve MODEL -- --enable-prefix-caching\n"
            "  dsclient serve MODEL --replicas 2   # two servers, ports 8000-8001\n"
            "  dsclient serve --list-profiles"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", help="a model folder (or a model id already cached)")
    p.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help=f"a named preset (default {DEFAULT_PROFILE}); see --list-profiles",
    )
    p.add_argument("--list-profiles", action="store_true", help="print the profiles and exit")
    p.add_argument("--max-num-seqs", type=int, help="batch size (default: from the profile)")
    p.add_argument("--max-model-len", type=int, help="context length (default: from profile)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other address is reachable from outside)",
    )
    p.add_argument("--port", type=int, help="port (default 8000 if free, else a free one)")
    p.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help=(
            "start N servers of MODEL on this machine, each on its own port (--port, --port+1,"
            " ...) and its share of the CPUs or GPUs; one URL per line; Ctrl-C or one replica"
            " exiting stops them all"
        ),
    )
    p.add_argument(
        "--sequential-start",
        action="store_true",
        help="with --replicas: start them one after another (default: all at once, faster here)",
    )
    p.add_argument("--served-model-name", help="name clients use (default: the folder's name)")
    p.add_argument("--dtype", help="weights dtype: auto, float32, bfloat16, float16, ...")
    p.add_argument("--kv-cache-dtype", help="KV cache dtype: auto, fp8, fp8_e4m3, fp8_e5m2, ...")
    p.add_argument("--block-size", type=int, help="KV cache block size in tokens")
    p.add_argument("--gpu-memory-utilization", type=float, help="GPU share for vLLM, (0, 1]")
    p.add_argument("--kv-cache-gib", type=int, help="CPU only: VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument("--python", help="the server venv's python (default: see docs/launcher.md)")
    p.add_argument("--log", dest="log_path", help="log file (default ~/.cache/dsclient/logs/)")
    p.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    p.add_argument(
        "--dev-mode",
        action="store_true",
        help=(
            "set VLLM_SERVER_DEV_MODE=1: /server_info reports max_num_seqs, but vLLM's"
            " development routes (/collective_rpc, /sleep, ...) open too; loopback only"
        ),
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the command and environment; start nothing"
    )
    p.add_argument(
        "--hardware",
        metavar="JSON",
        help=(
            'plan for other hardware instead of this machine, e.g. \'{"gpu_count": 1,'
            ' "gpu_mem_gib": 24}\' (fields of dsclient.launcher.Hardware;'
            " mostly with --dry-run)"
        ),
    )
    p.set_defaults(func=_serve, extra_args=[])


def _hardware_from_json(text: str) -> object:
    from ..launcher import Hardware

    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--hardware is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError("--hardware must be a JSON object")
    if "cpu_ids" in data:
        data["cpu_ids"] = tuple(data["cpu_ids"])
    elif "cpu_count" in data:
        data["cpu_ids"] = tuple(range(int(data.pop("cpu_count"))))
    try:
        return Hardware(**data)
    except TypeError as exc:
        raise ValueError(f"--hardware: {exc}") from exc


def _serve(args: argparse.Namespace) -> int:
    from .. import launcher

    if args.list_profiles:
        print(launcher.describe_profiles())
        return 0
    if not args.model:
        _err("dsclient serve: a MODEL is needed (or --list-profiles)")
        return 2
    hardware = _hardware_from_json(args.hardware) if args.hardware else None
    assert hardware is None or isinstance(hardware, launcher.Hardware)
    options: dict[str, Any] = dict(
        profile=args.profile,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_gib=args.kv_cache_gib,
        hardware=hardware,
        extra_args=args.extra_args,
        dev_mode=args.dev_mode,
    )
    if args.replicas is not None and args.replicas < 1:
        _err(f"dsclient serve: --replicas must be 1 or more, got {args.replicas}")
        return 2
    if args.dry_run:
        try:
            install = launcher.resolve_server_python(args.python)
        except launcher.LaunchError as exc:
            _err(f"# note: {exc}")
            install = launcher.VllmInstall(
                python=args.python or "python", dist="vllm", version="unknown"
            )
        if args.extra_args:
            _err("# checking the flags with vLLM's own argument parser (imports vLLM) ...")
        if args.replicas is not None:
            return _dry_run_replicas(args, install, options)
        plan = launcher.plan_launch(args.model, vllm=install, **options)
        print(f"# {install.dist} {install.version} ({install.python})")
        for note in plan.notes:
            print(f"# {note}")
        print(plan.shell())
        return 0
    if args.replicas is not None:
        return _serve_replicas(args, options)

    server = launcher.launch(
        args.model,
        python=args.python,
        log_path=args.log_path,
        startup_timeout=args.startup_timeout,
        progress=_err,
        **options,
    )
    for note in server.plan.notes:
        _err(f"# {note}")
    _sigterm_as_interrupt()
    try:
        server.start()
        # The URL on a line of its own (stdout), for people and scripts alike.
        print(f"dsclient: serving {server.model} at {server.url}", flush=True)
        _err(
            f"# max_num_seqs={server.max_num_seqs}, max_model_len={server.max_model_len};"
            f" OpenAI API at {server.url}/v1; log: {server.log_path}. Ctrl-C stops it."
        )
        code = server.wait()
        _err(f"vLLM exited with status {code}; see {server.log_path}")
        return 1
    except KeyboardInterrupt:
        _err("stopping vLLM ...")
        return 0
    finally:
        server.stop()


def _dry_run_replicas(args: argparse.Namespace, install: Any, options: dict[str, Any]) -> int:
    from ..launcher import launch_replicas

    group = launch_replicas(args.model, args.replicas, vllm=install, **options)
    print(f"# {install.dist} {install.version} ({install.python})")
    for note in group.notes:
        print(f"# {note}")
    for i, server in enumerate(group.servers):
        print(f"# replica {i + 1} of {len(group)}: {server.url}")
        for note in server.plan.notes:
            print(f"#   {note}")
        print(server.plan.shell())
    return 0


def _serve_replicas(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from .. import launcher

    group = launcher.launch(
        args.model,
        python=args.python,
        log_path=args.log_path,
        startup_timeout=args.startup_timeout,
        progress=_err,
        replicas=args.replicas,
        concurrent_start=not args.sequential_start,
        **options,
    )
    for note in group.notes:
        _err(f"# {note}")
    _sigterm_as_interrupt()
    try:
        group.start()
        for server in group.servers:
            print(f"dsclient: serving {server.model} at {server.url}", flush=True)
        first = group.servers[0]
        _err(
            f"# {len(group)} replicas, each max_num_seqs={first.max_num_seqs},"
            f" max_model_len={first.max_model_len}; logs: "
            + ", ".join(str(s.log_path) for s in group.servers)
            + ". Ctrl-C stops them all."
        )
        gone, code = group.wait()
        _err(
            f"vLLM at {gone.url} exited with status {code}; see {gone.log_path}."
            " Stopping the others."
        )
        return 1
    except KeyboardInterrupt:
        _err("stopping the replicas ...")
        return 0
    finally:
        group.stop()


def _sigterm_as_interrupt() -> None:
    """SIGTERM and SIGINT to the CLI stop the server the way Ctrl-C does.

    SIGINT is set explicitly because a shell starts background jobs with it ignored, and
    Python then never raises KeyboardInterrupt.
    """

    def handler(signum: int, frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "SIGTERM"):
        signal.signal(signal.SIGTERM, handler)
