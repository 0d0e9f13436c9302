"""Client cost in instructions, not seconds: callgrind counts per request for each map() leg.

    python -m benchmarks instructions                 # httpx, map, openai legs (~6 min)
    python -m benchmarks instructions --legs httpx,map --small 200 --large 1200
    python -m benchmarks instructions --source openai # generate() vs client.openai() (~20 min)
    python -m benchmarks instructions --source scale --concurrency 256  # client-scale legs (~6 min)

CPU seconds on this shared 2-core machine scatter by +-20 % from run to run, which is as large
as the effect being measured. ``valgrind --tool=callgrind`` counts the instructions a process
executes, the same for the same binary and inputs whatever else the machine does. Each leg of
``bench_map`` (the in-process mock server) runs twice under callgrind, with ``--small`` and
``--large`` requests; the difference divided by the difference in requests is the cost of one
request, free of start-up and import costs. Results: ``benchmarks/results/instructions.json``.

``--source openai`` counts the cost legs of ``bench_openai`` instead (``generate``,
``dsclient-openai``, ``openai-httpx``, and the first two with a metrics collector attached,
``generate-metrics`` and ``dsclient-openai-metrics``: 64 tasks on a client capped at 64, so no
task waits); dsclient's own share of ``client.openai()`` is ``dsclient-openai`` less
``openai-httpx`` (the same SDK on a plain ``httpx.AsyncClient`` over the same mock), reported
against ``generate``. Results: ``benchmarks/results/instructions_openai.json``.

``--source scale`` counts the legs of ``bench_client_scale`` (``aiohttp``, ``dsclient``,
``dsclient-map`` by default) at ``--concurrency`` in flight, against its local server (started
once, in its own process, so its instructions are not counted): the whole client, aiohttp and
the event loop included, with every call gathered at once as that benchmark does (so the calls
waiting for a slot, and what the garbage collector walks for them, count too). Results:
``benchmarks/results/instructions_scale.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "instructions.json"
#: source -> (the code one leg runs, default legs, the baseline leg ratios are taken to)
SOURCES = {
    "map": (
        "import sys; sys.path.insert(0, {bench!r}); import bench_map; "
        "bench_map.run_leg(sys.argv[1], int(sys.argv[2]))",
        "httpx,map,openai",
        "httpx",
    ),
    "openai": (
        "import asyncio, sys; sys.path.insert(0, {root!r}); "
        "from benchmarks.bench_openai import COST; "
        "asyncio.run(COST[sys.argv[1]](int(sys.argv[2]), 64))",
        "generate,dsclient-openai,openai-httpx,generate-metrics,dsclient-openai-metrics",
        "generate",
    ),
    "scale": (
        "import asyncio, sys; sys.path.insert(0, {root!r}); "
        "from benchmarks import bench_client_scale as b; "
        "asyncio.run(b.LEG_FUNCTIONS[sys.argv[1]]({url!r}, int(sys.argv[2]), {concurrency}))",
        "aiohttp,dsclient,dsclient-map",
        "aiohttp",
    ),
}


def instructions(
    leg: str, n: int, workdir: Path, source: str = "map", url: str = "", concurrency: int = 0
) -> int:
    """Instructions executed by a fresh interpreter that runs ``leg`` for ``n`` requests."""
    out = workdir / f"callgrind.{leg}.{n}"
    code = SOURCES[source][0].format(
        bench=str(ROOT / "benchmarks"), root=str(ROOT), url=url, concurrency=concurrency
    )
    done = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-c",
            code,
            leg,
            str(n),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    match = re.search(r"Collected : (\d+)", done.stderr)
    if match is None:
        raise RuntimeError(f"callgrind printed no total:\n{done.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=sorted(SOURCES), default="map")
    parser.add_argument("--legs", help="legs to count (default: the source's own)")
    parser.add_argument("--small", type=int, default=200, help="requests in the short run")
    parser.add_argument("--large", type=int, default=1200, help="requests in the long run")
    parser.add_argument(
        "--concurrency", type=int, default=256, help="in flight (--source scale only)"
    )
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    _, default_legs, baseline = SOURCES[args.source]
    per_request: dict[str, float] = {}
    server: subprocess.Popen[bytes] | None = None
    url = ""
    if args.source == "scale":
        from benchmarks.bench_client_scale import _free_port

        port = _free_port()
        serve = f"from benchmarks.bench_client_scale import serve; serve({port})"
        server = subprocess.Popen([sys.executable, "-c", serve], cwd=ROOT, stdout=subprocess.PIPE)
        assert server.stdout is not None
        server.stdout.readline()  # "ready"
        url = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for leg in (args.legs or default_legs).split(","):
                counts = [
                    instructions(leg, n, Path(tmp), args.source, url, args.concurrency)
                    for n in (args.small, args.large)
                ]
                per_request[leg] = (counts[1] - counts[0]) / (args.large - args.small)
                print(
                    f"  {leg:16} {per_request[leg] / 1000:8.0f} k instructions / request",
                    flush=True,
                )
    finally:
        if server is not None:
            server.terminate()
            server.wait()
    base = per_request.get(baseline)
    ratios = {leg: round(v / base, 2) for leg, v in per_request.items()} if base else {}
    report: dict[str, object] = {
        "source": args.source,
        "small": args.small,
        "large": args.large,
        **({"concurrency": args.concurrency} if args.source == "scale" else {}),
        "instructions_per_request": {k: round(v) for k, v in per_request.items()},
        f"ratio_to_{baseline}": ratios,
    }
    if args.source == "openai":
        from benchmarks.bench_openai import shares

        report.update(shares(per_request))
    name = "instructions.json" if args.source == "map" else f"instructions_{args.source}.json"
    path = RESULTS.with_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
