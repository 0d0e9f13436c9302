"""``dsclient probe``: what a server is and the in-flight cap dsclient would use."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from .._urls import root_url
from ._common import add_url, given_url


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
    add_url(p)
    p.add_argument("--model", help="the model to check (default: the server's only one)")
    p.add_argument("--api-key", help="bearer token (default: $DSCLIENT_API_KEY, $OPENAI_API_KEY)")
    p.add_argument("--headroom", type=float, default=0.7, help="cap = headroom x max_num_seqs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_run_probe)


def _unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why nothing answers at ``url`` (refused, no route, timed out), or ``None`` when something
    does: any HTTP status, 401 and 404 included, is an answer."""
    try:
        with urllib.request.urlopen(root_url(url) + "/v1/models", timeout=timeout):  # noqa: S310
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as exc:
        return str(exc.reason)
    except (OSError, ValueError) as exc:
        return str(exc) or type(exc).__name__


def _run_probe(args: argparse.Namespace) -> int:
    import anyio

    try:
        url = given_url(args)
    except ValueError as exc:
        print(f"dsclient probe: {exc}", file=sys.stderr)
        return 2
    why = _unreachable(url)
    if why is not None:
        print(f"dsclient probe: nothing answers at {url}: {why}", file=sys.stderr)
        return 1

    from ..client._client import AsyncClient

    async def probe() -> tuple[Any, Any, Any]:
        async with AsyncClient(
            url, model=args.model, api_key=args.api_key, headroom=args.headroom
        ) as client:
            return await client.discover(), client.stats().control, client.servers[0].load

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
            "limit_signal": control.signal,
            "limit_ceiling": control.ceiling,
            "limit_bound": _bound(info, control),
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
    elif control.mode == "throughput":
        print(
            "  the server publishes no queue metrics: the limit finds its knee from the answers"
            " (slow start while more in flight buys throughput, then holds where it only buys"
            f" latency), between 1 and {control.ceiling}; cut on 429/503"
        )
        print(
            "  requests ask for vLLM's load on each answer (endpoint-load-metrics); if the"
            " answers carry it, the limit follows the server's queue instead"
        )
    else:
        print("  fixed: the limit does not move (limit= or adaptive=False)")
    print(f"  bound: {_bound(info, control)}")
    return 0


def _bound(info: Any, control: Any) -> str:
    """What bounds the limit, in words: a hard cap the server states, a batch it states, or
    the queue guard alone (issue 41: the server's queue held near half its batch)."""
    sources = info.sources
    if control.mode == "fixed":
        return "none: the limit is fixed"
    if info.max_concurrent is not None:
        return (
            f"never more than {info.max_concurrent} in flight: a hard cap the server states "
            f"({sources.get('max_concurrent', '?')}) and refuses past"
        )
    stated = sources.get("max_num_seqs")
    if stated not in (None, "default", "ollama default"):
        return (
            f"a batch of {info.max_num_seqs} that the server queues behind ({stated}): the limit "
            "stops at it plus the target queue, unless completions prove more"
        )
    if control.mode == "throughput":
        return (
            "no batch stated: the limit starts at 1, and a queue guard keeps what is in flight "
            "within what the server is seen to run (throughput x unqueued time) plus half of it"
        )
    return "the server's own queue, held near its target"
