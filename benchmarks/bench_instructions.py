"""Client cost in instructions, not seconds: callgrind counts per request for each map() leg.

    python -m benchmarks instructions                 # httpx, map, openai legs (~6 min)
    python -m benchmarks instructions --legs httpx,map --small 200 --large 1200

CPU seconds on this shared 2-core machine scatter by +-20 % from run to run, which is as large
as the effect being measured. ``valgrind --tool=callgrind`` counts the instructions a process
executes, the same for the same binary and inputs whatever else the machine does. Each leg of
``bench_map`` (the in-process mock server) runs twice under callgrind, with ``--small`` and
``--large`` requests; the difference divided by the difference in requests is the cost of one
request, free of start-up and import costs. Results: ``benchmarks/results/instructions.json``.
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
LEG_SCRIPT = (
    "import sys; sys.path.insert(0, {bench!r}); import bench_map; "
    "bench_map.run_leg(sys.argv[1], int(sys.argv[2]))"
)


def instructions(leg: str, n: int, workdir: Path) -> int:
    """Instructions executed by a fresh interpreter that runs ``leg`` for ``n`` requests."""
    out = workdir / f"callgrind.{leg}.{n}"
    code = LEG_SCRIPT.format(bench=str(ROOT / "benchmarks"))
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
    parser.add_argument("--legs", default="httpx,map,openai", help="bench_map legs to count")
    parser.add_argument("--small", type=int, default=200, help="requests in the short run")
    parser.add_argument("--large", type=int, default=1200, help="requests in the long run")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    per_request: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for leg in args.legs.split(","):
            small = instructions(leg, args.small, Path(tmp))
            large = instructions(leg, args.large, Path(tmp))
            per_request[leg] = (large - small) / (args.large - args.small)
            print(f"  {leg:8} {per_request[leg] / 1000:8.0f} k instructions / request", flush=True)
    base = per_request.get("httpx")
    ratios = {leg: round(v / base, 2) for leg, v in per_request.items()} if base else {}
    report = {
        "small": args.small,
        "large": args.large,
        "instructions_per_request": {k: round(v) for k, v in per_request.items()},
        "ratio_to_httpx": ratios,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
