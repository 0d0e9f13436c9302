"""Run the benchmarks: ``python -m benchmarks [NAME [ARGS...]]``.

    python -m benchmarks                      # list them
    python -m benchmarks headline             # dsclient vs what you would use instead (~8 min)
    python -m benchmarks client-cost          # client CPU per request (mock transport, ~1 min)
    python -m benchmarks client-scale         # 16-1024 in flight: req/s, CPU per HTTP stack
    python -m benchmarks governor             # online + batch on a real tiny vLLM (~12 min)
    python -m benchmarks placement            # where vLLM's EngineCore runs (real vLLM, ~4 min)
    python -m benchmarks closed-loop          # closed-loop governor on hand-started vLLMs (real)
    python -m benchmarks soak                 # minutes at 80% of capacity; nothing creeps (~7 min)
    python -m benchmarks map                  # map() overhead and memory (mock transport)
    python -m benchmarks openai               # client.openai() vs openai as users run it (~6 min)
    python -m benchmarks instructions         # the same legs in callgrind instructions (~6 min)
    python -m benchmarks ray                  # Ray Data: dsclient.ray vs ray.data.llm (~6 min)
    python -m benchmarks shared               # 4 processes, one budget in Redis (real, ~6 min)
    python -m benchmarks replicas             # starting 2 vLLM replicas: in turn vs at once
    python -m benchmarks routing              # 2 replicas: dsclient vs round-robin vs vllm-router
    python -m benchmarks blackbox             # nginx'd vLLM, transformers serve, vLLM priority
    python -m benchmarks batch-shape          # map(): prefix groups, longest first vs input order
    python -m benchmarks seats                # servers with seats and a queue: their own queue
    python -m benchmarks governor --help      # each benchmark's own options
    python -m benchmarks report               # docs/benchmarks.md's tables from the kept results
    python -m benchmarks report --check       # exit 1 if the page is behind them

``nox -s bench -- governor`` (or ``make bench``) runs the same in nox's venv. The benchmarks that
write through ``benchmarks._results.Run`` keep one summary file per invocation in
``benchmarks/results/<name>/`` (in git); ``report`` renders the page's tables from those.
"""

from __future__ import annotations

import importlib
import signal
import sys
from typing import Any

#: name -> (module, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "headline": (
        "benchmarks.bench_headline",
        "dsclient vs openai, openai+semaphore, LiteLLM Router, plain gather (real tiny vLLM)",
    ),
    "client-cost": (
        "benchmarks.bench_client_cost",
        "client CPU per request: bare httpx vs dsclient vs openai (in-process mock server)",
    ),
    "client-scale": (
        "benchmarks.bench_client_scale",
        "16-1024 in flight on a free local server: req/s and CPU/request per HTTP stack",
    ),
    "governor": (
        "benchmarks.bench_governor",
        "online and batch latency on a real tiny vLLM: dsclient vs unbounded vs semaphore",
    ),
    "closed-loop": (
        "benchmarks.bench_closed_loop",
        "closed-loop governor on hand-started vLLMs: sweep, two processes, admission 503s",
    ),
    "placement": (
        "benchmarks.bench_placement",
        "vLLM's EngineCore on the engine's CPUs (the launcher) vs anywhere (vLLM), one server",
    ),
    "soak": (
        "benchmarks.bench_soak",
        "minutes at 80% of measured capacity: client RSS, sockets, tasks, in-flight stay flat",
    ),
    "map": (
        "benchmarks.bench_map",
        "map() overhead per item and peak memory (in-process mock server)",
    ),
    "openai": (
        "benchmarks.bench_openai",
        "client.openai() vs AsyncOpenAI plain / behind a semaphore: online p99, makespan, CPU",
    ),
    "shared": (
        "benchmarks.bench_shared",
        "four processes through a shared budget in Redis vs one process vs four uncoordinated",
    ),
    "instructions": (
        "benchmarks.bench_instructions",
        "map() and openai cost per request in callgrind instructions, against bare httpx",
    ),
    "ray": (
        "benchmarks.bench_ray",
        "a Ray Data job: dsclient.ray (alone, shared Redis budget) vs ray.data.llm HTTP processor",
    ),
    "replicas": (
        "benchmarks.bench_replicas",
        "start-up of N tiny-vLLM replicas through the launcher: one after another vs at once",
    ),
    "routing": (
        "benchmarks.bench_routing",
        "2 replicas, one slowed: dsclient vs client round-robin vs vllm-router (rr, cache_aware)",
    ),
    "blackbox": (
        "benchmarks.bench_blackbox",
        "servers without /metrics (vLLM behind nginx, transformers serve) and vLLM's own priority",
    ),
    "batch-shape": (
        "benchmarks.bench_batch_shape",
        "map() order='shape' (prefix groups, longest first) vs order='input' on a small KV cache",
    ),
    "seats": (
        "benchmarks.bench_seats",
        "servers with seats and a first-come queue (1-256): the server's own queue, throughput",
    ),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: python -m benchmarks NAME [ARGS...]", "", "benchmarks:"]
    lines += [f"  {name:{width}}  {about}" for name, (_, about) in BENCHMARKS.items()]
    lines += ["", "'python -m benchmarks NAME --help' shows a benchmark's options."]
    lines += ["'python -m benchmarks report [--check]' renders docs/benchmarks.md's tables."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "list"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name == "report":
        from benchmarks._report import main as report

        return report(rest)
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module: Any = importlib.import_module(BENCHMARKS[name][0])
    # `kill PID` (SIGTERM) leaves through the benchmarks' finally blocks, as Ctrl-C does: the
    # servers a benchmark started (vLLM in its own process group, nginx) are stopped, not left
    # running to spoil the next measurement.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # bench_map's main() reads sys.argv itself; the others take an argv list too.
    saved, sys.argv = sys.argv, [f"python -m benchmarks {name}", *rest]
    try:
        module.main()
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
