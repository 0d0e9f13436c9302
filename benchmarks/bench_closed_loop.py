"""The closed-loop governor on real (tiny, CPU) vLLM servers started by hand: three scenarios.

    python -m benchmarks closed-loop                              # all three; writes results/
    python -m benchmarks closed-loop --scenarios plain --place    # EngineCore moved, as launched
    python -m benchmarks closed-loop --runs 1 --requests 40 --sweep 8,32 --admission-requests 80

The servers are started BY HAND (``python -m vllm.entrypoints.openai.api_server ...``), not through
dsclient's launcher: no launch record, no dev mode, so discovery cannot read ``max_num_seqs``, and
no EngineCore placement unless ``--place`` applies the launcher's. The tiny random Llama is served
as ``"tiny"`` (``--max-model-len 2048``, float32). Every request is ~20 words in and 64 tokens out
with ``ignore_eos``, all submitted at once. Scenarios:

* **plain** (``--max-num-seqs``, 32): ``--requests`` (240) requests. Strategies: ``dsclient``
  (``AsyncClient(url)`` defaults, ``client.map(...)``), ``dsclient-gather`` (``asyncio.gather``
  over ``client.generate``), ``unbounded`` (``asyncio.gather`` over bare httpx posts) and
  ``semN`` for each N of ``--sweep`` (bare httpx behind ``asyncio.Semaphore(N)``). Summary:
  dsclient's makespan over the best error-free baseline of the same run (goal <= 1.1), and the
  server's queue (p90 of ``vllm:num_requests_waiting``) under dsclient vs unbounded.
* **two-process** (the same server): two OS processes, started together, each map N/2 through
  its own ``AsyncClient(url)``, against one process mapping all N. Reports each process's
  makespan, items/s and final ``client.limit``, the combined makespan over the single one, and
  fairness (the slower process's items/s over the faster's).
* **admission** (``--max-num-seqs 8 --max-num-queued-reqs 16``: vLLM answers 503 once waiting +
  running would pass 16): ``--admission-requests`` (320) requests through ``dsclient``, ``sem16``
  and ``unbounded``. Summary: dsclient failures (goal 0) and makespan over sem16's (goal <= 1.2).

Each scenario runs its strategies interleaved (A B C A B C, ``--runs`` times), each run with
fresh random prompts, so that drift on the machine and vLLM's prefix cache hit them alike; the
ratios are taken within a run. During each run vLLM's ``/metrics`` are polled every 0.2 s (engine
running mean; server queue mean, p90, max) and so is dsclient's ``client.limit`` (min, mean, max,
final). Latency p50 / p99 counts from submission, except under ``dsclient`` (``map()`` paces its
own calls; there it is ``result.latency_s``); "at server" counts from leaving the client's limit
(dsclient: ``latency_s - queued_s``). One vLLM runs at a time (a 2-core machine): plain and
two-process share one, admission gets its own; a vLLM already running is waited for (``--wait``)
and then refused. Raw results: ``benchmarks/results/closed_loop[_placed].json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import (
    ROOT,
    client_facts,
    default_placement,
    engine_sampler,
    hand_started_vllm,
    machine,
    median,
    percentile,
    placement_facts,
    sample_every,
    say,
    spread,
    starting_server,
    wait_for_no_vllm,
    words,
    write_results,
)

MODEL = "tiny"
MAX_MODEL_LEN = 2048
PROMPT_WORDS = 20
TOKENS_OUT = 64
IGNORE_EOS = {"ignore_eos": True}  # every answer is exactly TOKENS_OUT long
#: Requests sent at once to a fresh server before anything is measured.
WARM_UP = 40
SCENARIOS = ("plain", "two-process", "admission")
PLAIN_GOAL = 1.1  # dsclient makespan / best baseline's
ADMISSION_GOAL = 1.2  # dsclient makespan / sem16's
ADMISSION_SEQS = 8
ADMISSION_QUEUE = 16  # --max-num-queued-reqs: running + waiting past this gets 503
ADMISSION_GATE = f"sem{ADMISSION_QUEUE}"


# -- arguments -----------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """``"8,16,24"`` -> ``[8, 16, 24]``; every value must be >= 1."""
    values = [int(item) for item in text.split(",") if item.strip()]
    if any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks closed-loop", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    parser.add_argument("--runs", type=int, default=2, help="runs of each strategy per scenario")
    parser.add_argument("--requests", type=int, default=240, help="plain and two-process")
    parser.add_argument("--admission-requests", type=int, default=320)
    parser.add_argument(
        "--sweep", type=int_list, default=[8, 16, 24, 32, 48, 64], help="semN strategies (plain)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=32, help="plain and two-process")
    parser.add_argument(
        "--place", action="store_true", help="move the EngineCore as dsclient's launcher does"
    )
    parser.add_argument(
        "--shared-cpus", action="store_true",
        help="let the client share the server's CPUs (default: server on its own CPUs)",
    )  # fmt: skip
    parser.add_argument("--url", help="a running server for plain and two-process")
    parser.add_argument("--admission-url", help="a running server started with the admission flags")
    parser.add_argument("--pause", type=float, default=2.0, help="idle seconds between runs")
    parser.add_argument(
        "--wait", type=float, default=600.0, help="seconds to wait for another vLLM to stop"
    )
    parser.add_argument("--seed", type=int, default=20261202)
    # A two-process worker (run by this module itself): map --requests prompts at --start-at.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.scenarios = [name for name in args.scenarios.split(",") if name]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(
            f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    for name in ("runs", "requests", "admission_requests", "max_num_seqs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.worker and not args.url:
        parser.error("--worker needs --url")
    if args.place and (args.url or args.admission_url):
        parser.error("--place moves the EngineCore of a server this benchmark starts; drop --url")
    return args


def plain_strategies(sweep: list[int]) -> list[str]:
    return ["dsclient", "dsclient-gather", "unbounded", *(f"sem{n}" for n in sweep)]


# -- one run -------------------------------------------------------------------------------------
@dataclass
class Done:
    """One request's fate."""

    latency: float | None  # seconds from submission (map: result.latency_s)
    at_server: float | None  # seconds from leaving the client's limit to the answer
    error: str | None = None
    status: int | None = None  # the HTTP status, where the strategy sees it
    attempts: int = 1


def prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [words(rng, PROMPT_WORDS) for _ in range(n)]


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


async def via_httpx(url: str, texts: list[str], gate: int | None) -> tuple[list[Done], float]:
    """``asyncio.gather`` over bare httpx posts, behind ``Semaphore(gate)`` unless ``None``."""
    import httpx

    loop = asyncio.get_running_loop()
    semaphore = asyncio.Semaphore(gate) if gate else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:

        async def one(prompt: str) -> Done:
            submitted = loop.time()
            async with semaphore or contextlib.nullcontext():
                sent = loop.time()
                body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS_OUT}
                try:
                    response = await http.post(url + "/v1/completions", json=body | IGNORE_EOS)
                except httpx.HTTPError as exc:
                    return Done(loop.time() - submitted, None, error=describe(exc))
            done = loop.time()
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.text[:200]}"
                return Done(done - submitted, None, error=error, status=response.status_code)
            response.json()  # as a client would
            return Done(done - submitted, done - sent, status=200)

        begun = loop.time()
        done = await asyncio.gather(*(one(p) for p in texts))
        return list(done), loop.time() - begun


async def via_dsclient(
    url: str, texts: list[str], gather: bool
) -> tuple[list[Done], float, dict[str, Any]]:
    """``AsyncClient(url)`` with its defaults: ``map()``, or ``gather`` over ``generate()``."""
    import dsclient

    loop = asyncio.get_running_loop()
    async with (
        dsclient.AsyncClient(url) as client,  # discovery runs here, before the clock starts
        sample_every(lambda: client.limit) as limits,
    ):

        async def one(prompt: str) -> Done:
            submitted = loop.time()
            try:
                result = await client.generate(prompt, max_tokens=TOKENS_OUT, **IGNORE_EOS)
            except Exception as exc:  # counted, never fatal: errors are part of the result
                return Done(
                    loop.time() - submitted,
                    None,
                    error=describe(exc),
                    status=getattr(exc, "status", None),
                    attempts=getattr(exc, "attempts", 1),
                )
            return Done(
                loop.time() - submitted,
                result.latency_s - result.queued_s,
                attempts=result.attempts,
            )

        begun = loop.time()
        if gather:
            done = list(await asyncio.gather(*(one(p) for p in texts)))
        else:
            results = await client.map(texts, max_tokens=TOKENS_OUT, progress=False, **IGNORE_EOS)
            done = [
                Done(r.latency_s, r.latency_s - r.queued_s, attempts=r.attempts)
                if r.ok
                else Done(
                    None,
                    None,
                    error=describe(r.error),
                    status=getattr(r.error, "status", None),
                    attempts=r.attempts,
                )
                for r in results
            ]
        makespan = loop.time() - begun
        facts = client_facts(client)
    return done, makespan, {**facts, "limit_samples": spread(limits)}


async def run_strategy(name: str, url: str, texts: list[str]) -> dict[str, Any]:
    """One run of one strategy, the engine's gauges sampled meanwhile: a result row."""
    client: dict[str, Any] | None = None
    async with engine_sampler(url) as engine:
        if name in ("dsclient", "dsclient-gather"):
            done, makespan, client = await via_dsclient(url, texts, gather=name != "dsclient")
        elif name == "unbounded":
            done, makespan = await via_httpx(url, texts, None)
        elif name.startswith("sem"):
            done, makespan = await via_httpx(url, texts, int(name[3:]))
        else:
            raise ValueError(f"unknown strategy {name!r}")
    row: dict[str, Any] = {"strategy": name, **summarize(done, makespan)}
    row.update({f"engine_{key}": value for key, value in engine.items()})
    if client is not None:
        row["client"] = client
    row["error_samples"] = sorted({d.error for d in done if d.error})[:5]
    return row


def summarize(done: list[Done], makespan: float) -> dict[str, Any]:
    """Makespan, req/s (answers per second of makespan), latency percentiles, errors, retries."""
    ok = [d for d in done if d.error is None]

    def pct(values: list[float | None], percent: float) -> float | None:
        present = [v for v in values if v is not None]
        found = percentile(present, percent)
        return None if found is None else round(found, 3)

    row: dict[str, Any] = {
        "n": len(done),
        "makespan_s": round(makespan, 3),
        "req_per_s": round(len(ok) / makespan, 2) if makespan > 0 else None,
        "p50_s": pct([d.latency for d in ok], 50),
        "p99_s": pct([d.latency for d in ok], 99),
        "at_server_p50_s": pct([d.at_server for d in ok], 50),
        "at_server_p99_s": pct([d.at_server for d in ok], 99),
        "errors": len(done) - len(ok),
        "http_503": sum(d.status == 503 for d in done),
        "retried": sum(d.attempts > 1 for d in done),
        "retries": sum(d.attempts - 1 for d in done),
    }
    return row


# -- summaries (pure) ----------------------------------------------------------------------------
def compare(
    rows: list[dict[str, Any]], strategy: str, baselines: list[str], goal: float
) -> dict[str, Any]:
    """``strategy``'s makespan over the best error-free baseline's, run by run; median vs goal."""
    per_run = []
    for run in sorted({r["run"] for r in rows}):
        mine = {r["strategy"]: r for r in rows if r["run"] == run}
        if strategy not in mine:
            continue
        clean = {
            name: mine[name]["makespan_s"]
            for name in baselines
            if name in mine and not mine[name]["errors"] and mine[name]["makespan_s"] > 0
        }
        best = min(clean, key=clean.__getitem__) if clean else None
        ratio = round(mine[strategy]["makespan_s"] / clean[best], 3) if best else None
        per_run.append({"run": run, "best": best, "ratio": ratio})
    ratios = [p["ratio"] for p in per_run if p["ratio"] is not None]
    middle = median(ratios) if ratios else None
    return {
        "strategy": strategy,
        "goal": goal,
        "ratio_median": middle,
        "met": middle is not None and middle <= goal,
        "runs": per_run,
    }


def plain_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    baselines = sorted({r["strategy"] for r in rows if not r["strategy"].startswith("dsclient")})
    queue: dict[str, list[float]] = {"dsclient": [], "unbounded": []}
    targets: list[int] = []  # the queue dsclient's controller aimed at, at the end of each run
    for row in rows:
        if row["strategy"] in queue and "engine_waiting_p90" in row:
            queue[row["strategy"]].append(row["engine_waiting_p90"])
        control = (row.get("client") or {}).get("control")
        if row["strategy"] == "dsclient" and isinstance(control, dict):
            targets += [control["target_waiting"]] if control.get("target_waiting") else []
    return {
        "queue_target": targets,
        "dsclient": compare(rows, "dsclient", baselines, PLAIN_GOAL),
        "dsclient-gather": compare(rows, "dsclient-gather", baselines, PLAIN_GOAL),
        "queue_p90": queue,
        "queue_p90_median": {
            name: median(values) if values else None for name, values in queue.items()
        },
    }


def admission_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    found = compare(rows, "dsclient", [ADMISSION_GATE], ADMISSION_GOAL)
    failures = sum(r["errors"] for r in rows if r["strategy"] == "dsclient")
    return {**found, "dsclient_failures": failures, "met": found["met"] and failures == 0}


def two_process_summary(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round: combined makespan of the two processes over the single one's, and fairness."""
    out = []
    for entry in rounds:
        single, pair = entry["single"][0], entry["two"]
        combined = max(p["ended"] for p in pair) - min(p["begun"] for p in pair)
        speeds = [p["items_per_s"] for p in pair]
        out.append(
            {
                "round": entry["round"],
                "single_makespan_s": round(single["makespan_s"], 3),
                "combined_makespan_s": round(combined, 3),
                "ratio": round(combined / single["makespan_s"], 3),
                "fairness": round(min(speeds) / max(speeds), 3) if max(speeds) > 0 else None,
                "final_limits": [p.get("limit") for p in pair],
                "single_final_limit": single.get("limit"),
            }
        )
    return out


# -- scenarios -----------------------------------------------------------------------------------
async def warm_up(url: str, seed: int, gate: int | None = None) -> None:
    say(f"warming {url} up with {WARM_UP} requests ...")
    done, _ = await via_httpx(url, prompts(seed, WARM_UP), gate)
    errors = [d.error for d in done if d.error]
    if errors:
        say(f"  {len(errors)} warm-up requests failed, e.g. {errors[0]}")


async def interleaved(
    url: str, names: list[str], n: int, args: argparse.Namespace, label: str
) -> list[dict[str, Any]]:
    rows = []
    for run in range(1, args.runs + 1):
        for name in names:
            seed = args.seed + 7919 * (len(rows) + 1) + (1000 if label == "admission" else 0)
            say(f"{label} run {run} {name}: {n} requests ...")
            row = {"run": run, **await run_strategy(name, url, prompts(seed, n))}
            say("  " + json.dumps({k: v for k, v in row.items() if k != "error_samples"}))
            rows.append(row)
            await asyncio.sleep(args.pause)
    return rows


def worker_argv(url: str, n: int, seed: int, start_at: float) -> list[str]:
    return [
        sys.executable, "-m", "benchmarks.bench_closed_loop", "--worker",
        "--url", url, "--requests", str(n), "--seed", str(seed), "--start-at", repr(start_at),
    ]  # fmt: skip


async def processes(url: str, sizes: list[int], seed: int, lead: float = 5.0) -> dict[str, Any]:
    """Run one worker process per size, all starting their map at the same wall-clock time."""
    start_at = time.time() + lead  # time to import dsclient and discover, in every process
    async with engine_sampler(url) as engine:
        procs = [
            await asyncio.create_subprocess_exec(
                *worker_argv(url, n, seed + i, start_at), cwd=ROOT, stdout=asyncio.subprocess.PIPE
            )
            for i, n in enumerate(sizes)
        ]
        outputs = await asyncio.gather(*(p.communicate() for p in procs))
    results = []
    for proc, (stdout, _) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"a two-process worker failed with status {proc.returncode}")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return {"workers": results, **{f"engine_{k}": v for k, v in engine.items()}}


async def two_process(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    n = args.requests
    rounds = []
    for round_ in range(1, args.runs + 1):
        entry: dict[str, Any] = {"round": round_}
        for mode, sizes in (("single", [n]), ("two", [n // 2, n - n // 2])):
            say(f"two-process round {round_}: {mode} ({' + '.join(map(str, sizes))}) ...")
            seed = args.seed + 104729 * round_ + len(sizes)
            got = await processes(url, sizes, seed)
            entry[mode] = got.pop("workers")
            entry[f"{mode}_engine"] = got
            for worker in entry[mode]:
                say("  " + json.dumps({k: v for k, v in worker.items() if k != "control"}))
            await asyncio.sleep(args.pause)
        rounds.append(entry)
    return rounds


async def worker_run(url: str, texts: list[str], start_at: float) -> dict[str, Any]:
    import dsclient

    async with dsclient.AsyncClient(url) as client:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        late = time.time() - start_at
        async with sample_every(lambda: client.limit) as limits:
            begun = time.time()
            results = await client.map(texts, max_tokens=TOKENS_OUT, progress=False, **IGNORE_EOS)
            ended = time.time()
        facts = client_facts(client)
    ok = sum(1 for r in results if r.ok)
    return {
        "items": len(results),
        "ok": ok,
        "failed": len(results) - ok,
        "begun": begun,
        "ended": ended,
        "late_s": round(late, 3),
        "makespan_s": round(ended - begun, 3),
        "items_per_s": round(ok / (ended - begun), 2),
        "retried": sum(1 for r in results if r.attempts > 1),
        **facts,
        "limit_samples": spread(limits),
    }


async def shared_server(url: str, args: argparse.Namespace) -> dict[str, Any]:
    await warm_up(url, args.seed - 1)
    found: dict[str, Any] = {}
    if "plain" in args.scenarios:
        rows = await interleaved(url, plain_strategies(args.sweep), args.requests, args, "plain")
        found["plain"] = {"rows": rows, "summary": plain_summary(rows)}
    if "two-process" in args.scenarios:
        rounds = await two_process(url, args)
        found["two-process"] = {"rounds": rounds, "summary": two_process_summary(rounds)}
    return found


async def admission_server(url: str, args: argparse.Namespace) -> dict[str, Any]:
    await warm_up(url, args.seed - 2, gate=ADMISSION_QUEUE)  # past it, vLLM answers 503
    names = ["dsclient", ADMISSION_GATE, "unbounded"]
    rows = await interleaved(url, names, args.admission_requests, args, "admission")
    return {"admission": {"rows": rows, "summary": admission_summary(rows)}}


# -- servers -------------------------------------------------------------------------------------
@contextlib.contextmanager
def server(
    args: argparse.Namespace, url: str | None, max_num_seqs: int, extra: list[str]
) -> Iterator[tuple[str, dict[str, Any]]]:
    """``url`` as given, or a vLLM started by hand for the block (after any other has gone)."""
    if url:
        yield url.rstrip("/"), {"url": url, "started": False}
        return
    from dsclient.launcher import make_tiny_model, plan_launch, resolve_server_python

    wait_for_no_vllm(timeout=args.wait)
    install = resolve_server_python()
    model = make_tiny_model(python=install.python)
    placement = default_placement(apart=not getattr(args, "shared_cpus", False))
    cpus = None
    with contextlib.ExitStack() as stack:
        # Started on the server's CPUs (it inherits them; the plan reads them), then this
        # process, the client, moves to its own.
        with starting_server(placement):
            if args.place:  # where dsclient's launcher would put the EngineCore on these CPUs
                plan = plan_launch(
                    model, vllm=install, max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                    served_model_name=MODEL, dtype="float32",
                )  # fmt: skip
                cpus = plan.engine_core_cpus
            started = stack.enter_context(
                hand_started_vllm(
                    install.python,
                    model,
                    max_num_seqs=max_num_seqs,
                    max_model_len=MAX_MODEL_LEN,
                    served_model_name=MODEL,
                    extra_args=extra,
                    engine_core_cpus=cpus,
                )
            )
        yield (
            started.url,
            {
                "url": started.url,
                "started": True,
                "vllm": f"{install.dist} {install.version}",
                "argv": started.argv[1:],
                "log": str(started.log_path),
                "placement": placement_facts(placement, [started.pid]),
                **started.facts,
            },
        )


# -- output --------------------------------------------------------------------------------------
def _num(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def runs_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | run | makespan s | req/s | p50 / p99 s | at server p50 / p99 s | errors "
        "| 503s | retried | engine running | server queue mean / p90 / max "
        "| limit min / mean / max / final |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dsclient = r["strategy"].startswith("dsclient")
        limits = (r.get("client") or {}).get("limit_samples") or {}
        cells = [
            r["strategy"],
            str(r["run"]),
            f"{r['makespan_s']:.2f}",
            _num(r["req_per_s"], ".1f"),
            f"{_num(r['p50_s'])} / {_num(r['p99_s'])}"
            + (" (call)" if r["strategy"] == "dsclient" else ""),
            f"{_num(r['at_server_p50_s'])} / {_num(r['at_server_p99_s'])}",
            str(r["errors"]),
            "-" if dsclient else str(r["http_503"]),
            str(r["retried"]) if dsclient else "-",
            _num(r.get("engine_running_mean"), ".1f"),
            " / ".join(
                _num(r.get(f"engine_waiting_{key}"), spec)
                for key, spec in (("mean", ".1f"), ("p90", "g"), ("max", "g"))
            ),
            " / ".join(_num(limits.get(key), "g") for key in ("min", "mean", "max", "final"))
            if limits
            else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goal_line(found: dict[str, Any], against: str) -> str:
    runs = ", ".join(f"{_num(p['ratio'], '.2f')} vs {p['best'] or 'none'}" for p in found["runs"])
    verdict = "met" if found["met"] else "NOT met"
    return (
        f"{found['strategy']} makespan / {against}: median **{_num(found['ratio_median'])}** "
        f"(goal <= {found['goal']}: {verdict}; by run: {runs})"
    )


def two_process_table(rounds: list[dict[str, Any]], summary: list[dict[str, Any]]) -> str:
    lines = [
        "| round | mode | process | items | makespan s | items/s | failed | final limit | late s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in rounds:
        for mode in ("single", "two"):
            for i, w in enumerate(entry[mode], 1):
                lines.append(
                    f"| {entry['round']} | {mode} | {i} | {w['items']} | {w['makespan_s']:.2f} "
                    f"| {w['items_per_s']:.1f} | {w['failed']} | {w.get('limit')} "
                    f"| {w['late_s']:.2f} |"
                )
    lines.append("")
    for s in summary:
        lines.append(
            f"round {s['round']}: two processes together {s['combined_makespan_s']:.2f} s vs one "
            f"{s['single_makespan_s']:.2f} s (**{s['ratio']:.2f}x**); fairness "
            f"{_num(s['fairness'])}; final limits {s['final_limits']} (single "
            f"{s['single_final_limit']})"
        )
    return "\n".join(lines)


def report(payload: dict[str, Any]) -> str:
    parts = []
    if "plain" in payload:
        plain = payload["plain"]
        queue = plain["summary"]["queue_p90_median"]
        parts += [
            "## plain", runs_table(plain["rows"]), "",
            goal_line(plain["summary"]["dsclient"], "best of unbounded and semN"),
            goal_line(plain["summary"]["dsclient-gather"], "best of unbounded and semN"),
            f"server queue p90 (median of runs): dsclient {_num(queue['dsclient'], 'g')} "
            f"(its target: {', '.join(map(str, plain['summary']['queue_target'])) or '-'}), "
            f"unbounded {_num(queue['unbounded'], 'g')}",
        ]  # fmt: skip
    if "two-process" in payload:
        found = payload["two-process"]
        parts += ["", "## two-process", two_process_table(found["rounds"], found["summary"])]
    if "admission" in payload:
        found = payload["admission"]
        parts += [
            "", "## admission", runs_table(found["rows"]), "",
            goal_line(found["summary"], ADMISSION_GATE)
            + f"; dsclient failures {found['summary']['dsclient_failures']} (goal 0)",
        ]  # fmt: skip
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        texts = prompts(args.seed, args.requests)
        found = asyncio.run(worker_run(args.url.rstrip("/"), texts, args.start_at))
        print(json.dumps(found), flush=True)
        return
    started = time.monotonic()
    payload: dict[str, Any] = {"servers": {}}
    if {"plain", "two-process"} & set(args.scenarios):
        with server(args, args.url, args.max_num_seqs, []) as (url, facts):
            payload["servers"]["shared"] = facts
            payload.update(asyncio.run(shared_server(url, args)))
    if "admission" in args.scenarios:
        extra = ["--max-num-queued-reqs", str(ADMISSION_QUEUE)]
        with server(args, args.admission_url, ADMISSION_SEQS, extra) as (url, facts):
            payload["servers"]["admission"] = facts
            payload.update(asyncio.run(admission_server(url, args)))
    payload.update(machine=machine(), args=vars(args), wall_s=round(time.monotonic() - started, 1))
    path = write_results("closed_loop" + ("_placed" if args.place else ""), payload)
    print(report(payload))
    print(f"\nwrote {path} in {payload['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
