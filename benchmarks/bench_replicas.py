"""Starting N tiny-vLLM replicas through the launcher: one after another vs all at once.

    python -m benchmarks replicas                    # 2 replicas, each order once (~5-10 min)
    python -m benchmarks replicas --rounds 2 --replicas 2

Each round starts ``--replicas`` servers of the tiny model with ``launch(..., replicas=N,
concurrent_start=...)`` and times ``start()`` until every one answers ``/health`` (the launcher's
own wait), then stops them. The orders alternate (sequential first in odd rounds, concurrent
first in even ones) and the machine's load (``/proc/loadavg``) is recorded before each start.
``--cold`` gives every start an empty vLLM cache (a first start: vLLM compiles the model; one
after another, the second replica would find the first one's compiled graphs in a shared cache).
Results go to ``benchmarks/results/replicas.json`` (``replicas-cold.json``); the launcher's
default follows from them (docs/launcher.md, "Replicas"). Hold the vLLM lock while it runs:
``flock /tmp/dsclient-vllm.lock python -m benchmarks replicas``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import machine, say, write_results


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, as ``uptime`` shows them."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def one_start(
    model: str, python: str, replicas: int, concurrent: bool, timeout: float
) -> dict[str, Any]:
    from dsclient.launcher import ServerStartError, launch

    group = launch(
        model,
        python=python,
        max_num_seqs=8,
        max_model_len=2048,
        served_model_name="tiny",
        dtype="float32",
        replicas=replicas,
        concurrent_start=concurrent,
        startup_timeout=timeout,
        progress=lambda m: None,
    )
    load = loadavg()
    begun = time.monotonic()
    try:
        group.start()
        seconds: float | None = time.monotonic() - begun
        error = None
    except ServerStartError as exc:
        seconds = None
        error = str(exc).splitlines()[0]
    finally:
        group.stop()
    order = "concurrent" if concurrent else "sequential"
    took = f"{seconds:.0f} s" if seconds is not None else error
    say(f"  {order}: {took} (load {load})")
    return {"order": order, "seconds": seconds, "error": error, "load_before": load}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks replicas", description=__doc__)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="startup_timeout, seconds")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="each start with an empty vLLM cache (VLLM_CACHE_ROOT in a fresh temporary folder):"
        " vLLM compiles the model again, as on a first start",
    )
    args = parser.parse_args(argv)

    from dsclient.launcher import make_tiny_model, resolve_server_python

    install = resolve_server_python()
    model = str(make_tiny_model(python=install.python))
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        say(f"round {r + 1} of {args.rounds}")
        orders = (False, True) if r % 2 == 0 else (True, False)
        for concurrent in orders:
            if args.cold:
                os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cold-cache-")
            runs.append(
                {
                    "round": r + 1,
                    **one_start(model, install.python, args.replicas, concurrent, args.timeout),
                }
            )
    name = "replicas-cold" if args.cold else "replicas"
    payload = {"machine": machine(), "replicas": args.replicas, "cold": args.cold, "runs": runs}
    path = write_results(name, payload)
    say(f"results: {path}")
    for run in runs:
        took = f"{run['seconds']:.0f} s" if run["seconds"] is not None else run["error"]
        print(f"round {run['round']} {run['order']:>10}: {took}  (load {run['load_before']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
