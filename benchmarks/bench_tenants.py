"""Tenants on one server: a flooding tenant beside a light one, FIFO vs priority vs caps vs VTC.

    python -m benchmarks tenants                       # launches vLLM (twice) and redis-server
    python -m benchmarks tenants --runs 1 --duration 20
    python -m benchmarks tenants --no-priority         # without the vLLM-priority leg's restart

The tiny random Llama is launched through dsclient's launcher with ``max_num_seqs`` 8 (2048
context), and a redis-server on a free loopback port (``tests/redis_server.py``). Two tenants:

* ``flood`` sends long prompts (~``--long-words`` words, about 1.3 tokens each) at 10x the rate
  of ``light``, enough to keep the server's batch full;
* ``light`` sends short prompts (20 words) at ``--light-rate`` calls a second (Poisson).

Both ask for ``--max-tokens`` (32) with ``ignore_eos``. Every leg runs its tenants in worker
processes started together (``--duration`` seconds of arrivals, then ``--grace`` seconds to
finish; what is still running then is cancelled and counted unfinished). Legs:

* ``light-solo``: light alone through dsclient: its p99 is the yardstick;
* ``fifo``: both through one unbounded ``openai.AsyncOpenAI`` (the server's first come, first
  served);
* ``vllm-priority``: the same, on a second vLLM started with ``--scheduling-policy priority``,
  light's calls sent with ``priority`` 0 and flood's with 1 (light first);
* ``group-caps``: one dsclient client, ``group_caps={"flood": 0.5}``, as dsclient was before
  tenants (``--caps-ref``, the commit the tenants branch started from, checked out into a
  temporary folder for that leg only);
* ``vtc``: one dsclient client, each call's ``group=`` its tenant (no configuration);
* ``vtc-2proc``: the two tenants in two processes, ``shared=`` one Redis;
* ``backlog-equal`` / ``backlog-3to1``: both tenants backlogged (every call submitted at once,
  more than the duration serves), equal weights / ``group_weights={"flood": 3}``; tokens served
  (input + output from ``usage``) per ``--window`` seconds, Jain's index of the two tenants'
  tokens over their weights, and the ratio of their tokens;
* ``backlog-2proc``: ``backlog-equal`` with the tenants in two processes sharing Redis;
* ``lone-group`` / ``lone-plain``: flood's backlog alone, with ``group="flood"`` and without a
  group (a single-tenant client): throughput.

Goals (issue 44): light's p99 in ``vtc`` and ``vtc-2proc`` at most 1.2x ``light-solo``'s;
Jain's index at least 0.95 in every window of the equal legs, tokens in the weights' proportion
(3 +- 10%) in the weighted one; total tokens per second at least 0.95x ``fifo``'s, and
``lone-group`` at least 0.95x ``lone-plain``'s. One summary row per leg and run is kept in
``benchmarks/results/tenants/<UTC start>.json`` (:mod:`benchmarks._results`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import ROOT, machine, percentile, say, tiny_vllm, words
from benchmarks._results import Run

MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 2048
#: The commit the tenants work started from: dsclient with group caps and no token fairness.
CAPS_REF = "d63489c"
P99_GOAL = 1.2
JAIN_GOAL = 0.95
THROUGHPUT_GOAL = 0.95
LEGS = (
    "light-solo",
    "fifo",
    "group-caps",
    "vtc",
    "vtc-2proc",
    "backlog-equal",
    "backlog-3to1",
    "backlog-2proc",
    "lone-group",
    "lone-plain",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks tenants", description=__doc__)
    p.add_argument("--url", help="a running vLLM (default: launch the tiny one)")
    p.add_argument("--redis", help="a running Redis (default: start redis-server)")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals a leg")
    p.add_argument("--grace", type=float, default=10.0, help="seconds to finish after them")
    p.add_argument("--window", type=float, default=10.0, help="seconds per fairness window")
    p.add_argument("--light-rate", type=float, default=3.0, help="light's calls a second")
    p.add_argument("--long-words", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--caps-ref", default=CAPS_REF)
    p.add_argument("--no-priority", action="store_true", help="skip the vllm-priority leg")
    p.add_argument("--legs", default=",".join(LEGS), help="comma-separated legs to run")
    p.add_argument("--wait-for-others", type=float, default=120.0, metavar="SECONDS")
    # worker mode
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one worker process ---------------------------------------------------------------------------
def _prompt(rng: random.Random, tenant: str, args: dict[str, Any]) -> str:
    return words(rng, args["long_words"] if tenant == "flood" else 20)


def _arrivals(spec: dict[str, Any], rng: random.Random) -> list[float]:
    """When each of a tenant's calls is sent, from the leg's start: Poisson at ``rate``, or all
    at once (``backlog``: ``n`` calls)."""
    if spec.get("backlog"):
        return [0.0] * spec["n"]
    out, t = [], 0.0
    while True:
        t += rng.expovariate(spec["rate"])
        if t >= spec["duration"]:
            return out
        out.append(t)


async def _call_openai(sdk: Any, text: str, tenant: str, spec: dict[str, Any]) -> tuple[int, int]:
    extra: dict[str, Any] = {"ignore_eos": True}
    if spec.get("priority") is not None:
        extra["priority"] = spec["priority"]
    r = await sdk.completions.create(
        model="tiny", prompt=text, max_tokens=spec["max_tokens"], extra_body=extra
    )
    return r.usage.prompt_tokens, r.usage.completion_tokens


async def worker(job: dict[str, Any]) -> dict[str, Any]:
    """Run ``job``'s tenants against ``job["url"]`` from ``job["start_at"]`` (wall clock); one
    record per call: tenant, sent, ended (seconds from the start; ``None``: unfinished), ok,
    prompt and completion tokens."""
    import dsclient

    client_kind = job["client"]
    records: list[list[Any]] = []
    deadline = job["start_at"] + job["duration"] + job["grace"]
    async with contextlib.AsyncExitStack() as stack:
        if client_kind == "openai":
            import httpx
            import openai

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            http = httpx.AsyncClient(limits=limits, timeout=600.0)
            stack.push_async_callback(http.aclose)
            sdk = openai.AsyncOpenAI(
                base_url=job["url"] + "/v1", api_key="EMPTY", max_retries=0, http_client=http
            )
            client = None
        else:
            options = dict(job.get("options", {}))
            client = await stack.enter_async_context(dsclient.AsyncClient(job["url"], **options))
            await client.discover()
        rngs = {s["tenant"]: random.Random(f"{job['seed']}-{s['tenant']}") for s in job["tenants"]}
        plans = [
            (t, s, _prompt(rngs[s["tenant"]], s["tenant"], job))
            for s in job["tenants"]
            for t in _arrivals(s, rngs[s["tenant"]])
        ]
        plans.sort(key=lambda p: p[0])
        await asyncio.sleep(max(0.0, job["start_at"] - time.time()))
        begun = time.monotonic()

        async def one(at: float, spec: dict[str, Any], text: str) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - begun)))
            sent = time.monotonic() - begun
            row: list[Any] = [spec["tenant"], round(sent, 4), None, False, 0, 0]
            records.append(row)
            try:
                if client is None:
                    prompt_tokens, completion_tokens = await _call_openai(
                        sdk, text, spec["tenant"], spec
                    )
                else:
                    group = spec.get("group")
                    kwargs = {"group": group} if group is not None else {}
                    result = await client.generate(
                        text, max_tokens=spec["max_tokens"], ignore_eos=True, **kwargs
                    )
                    prompt_tokens = result.usage.prompt_tokens
                    completion_tokens = result.usage.completion_tokens
            except asyncio.CancelledError:
                raise
            except Exception:  # a failure is counted, not raised
                row[2] = round(time.monotonic() - begun, 4)
                return
            row[2:] = [round(time.monotonic() - begun, 4), True, prompt_tokens, completion_tokens]

        tasks = [asyncio.ensure_future(one(at, spec, text)) for at, spec, text in plans]
        await asyncio.wait(tasks, timeout=max(0.0, deadline - time.time()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tenants = getattr(client.stats(), "tenants", {}) if client is not None else {}
    return {
        "dsclient": dsclient.__file__,
        "records": records,
        "tenant_stats": {
            str(k): {"counter": round(v.counter, 1), "done": v.done} for k, v in tenants.items()
        },
    }


# -- a leg ----------------------------------------------------------------------------------------
def _tenant(name: str, args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    rate = args.light_rate * (10 if name == "flood" else 1)
    spec = {"tenant": name, "rate": rate, "duration": args.duration, "max_tokens": args.max_tokens}
    spec.update(more)
    return spec


def plan_leg(name: str, args: argparse.Namespace, url: str, redis_url: str) -> list[dict[str, Any]]:
    """The worker jobs of leg ``name`` (one per process)."""
    base = {"url": url, "duration": args.duration, "grace": args.grace, "seed": args.seed,
            "long_words": args.long_words}  # fmt: skip
    # More than a leg serves (the figures say whether both stayed backlogged: "backlogged").
    flood_n = int(args.duration * 25)
    light_n = int(args.duration * 120)
    grouped = {"group": "flood"}, {"group": "light"}
    if name == "light-solo":
        return [{**base, "client": "dsclient", "tenants": [_tenant("light", args, **grouped[1])]}]
    if name in ("fifo", "vllm-priority"):
        prio = name == "vllm-priority"
        tenants = [
            _tenant("flood", args, priority=1 if prio else None),
            _tenant("light", args, priority=0 if prio else None),
        ]
        return [{**base, "client": "openai", "tenants": tenants}]
    if name == "group-caps":
        tenants = [_tenant("flood", args, **grouped[0]), _tenant("light", args)]
        options = {"group_caps": {"flood": 0.5}}
        return [{**base, "client": "caps-ref", "options": options, "tenants": tenants}]
    if name == "vtc":
        tenants = [_tenant("flood", args, **grouped[0]), _tenant("light", args, **grouped[1])]
        return [{**base, "client": "dsclient", "tenants": tenants}]
    shared = {"shared": redis_url, "shared_key": f"tenants-{time.time_ns()}"}
    if name == "vtc-2proc":
        return [
            {**base, "client": "dsclient", "options": shared,
             "tenants": [_tenant(t, args, **g)]}
            for t, g in zip(("flood", "light"), grouped, strict=True)
        ]  # fmt: skip
    backlog = {"flood": {"backlog": True, "n": flood_n}, "light": {"backlog": True, "n": light_n}}
    if name in ("backlog-equal", "backlog-3to1"):
        options = {"group_weights": {"flood": 3}} if name == "backlog-3to1" else {}
        tenants = [
            _tenant(t, args, **g, **backlog[t])
            for t, g in zip(("flood", "light"), grouped, strict=True)
        ]
        return [{**base, "client": "dsclient", "options": options, "tenants": tenants}]
    if name == "backlog-2proc":
        return [
            {**base, "client": "dsclient", "options": shared,
             "tenants": [_tenant(t, args, **g, **backlog[t])]}
            for t, g in zip(("flood", "light"), grouped, strict=True)
        ]  # fmt: skip
    if name in ("lone-group", "lone-plain"):
        more = {"group": "flood"} if name == "lone-group" else {}
        return [
            {**base, "client": "dsclient",
             "tenants": [_tenant("flood", args, **more, **backlog["flood"])]}
        ]  # fmt: skip
    raise ValueError(f"no leg named {name!r}")


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """``dsclient/`` as of ``ref``, in a temporary folder (for the group-caps leg)."""
    with tempfile.TemporaryDirectory(prefix="dsclient-ref-") as tmp:
        archive = subprocess.run(
            ["git", "archive", ref, "dsclient"], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield Path(tmp)


async def run_leg(jobs: list[dict[str, Any]], ref_dir: Path | None) -> list[dict[str, Any]]:
    start_at = time.time() + 8.0  # time to import dsclient, discover, take a first lease
    procs = []
    for job in jobs:
        job = {**job, "start_at": start_at}
        env = dict(os.environ)
        cwd = ROOT
        code = "import sys; from benchmarks.bench_tenants import main; main()"
        if job["client"] == "caps-ref":
            assert ref_dir is not None
            job["client"] = "dsclient"
            cwd = ref_dir  # its dsclient/ comes first on the path; benchmarks/ from ROOT
            env["PYTHONPATH"] = str(ROOT)
        argv = [sys.executable, "-c", code, "--worker", json.dumps(job)]
        procs.append(
            await asyncio.create_subprocess_exec(
                *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE
            )
        )
    outputs = await asyncio.gather(*(p.communicate() for p in procs))
    results = []
    for proc, (stdout, _) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"a worker failed with status {proc.returncode}")
        results.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    return results


# -- figures --------------------------------------------------------------------------------------
def jain(values: Sequence[float]) -> float | None:
    """Jain's fairness index: 1 when all are equal, 1/n when one takes everything."""
    total, squares = sum(values), sum(v * v for v in values)
    return None if not squares else total * total / (len(values) * squares)


def figures(name: str, results: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """One leg's summary: per tenant p99 and unfinished calls; tokens per second; in backlog
    legs, per window tokens per tenant, Jain's index and the ratio."""
    records = [r for result in results for r in result["records"]]
    out: dict[str, Any] = {}
    horizon = args.duration + args.grace
    for tenant in ("flood", "light"):
        mine = [r for r in records if r[0] == tenant]
        if not mine:
            continue
        # A call unfinished at the end counts at the time it had waited then (a lower bound).
        latencies = [(r[2] if r[2] is not None else horizon) - r[1] for r in mine]
        out[f"{tenant}_n"] = len(mine)
        out[f"{tenant}_unfinished"] = sum(1 for r in mine if r[2] is None)
        out[f"{tenant}_failed"] = sum(1 for r in mine if r[2] is not None and not r[3])
        p99 = percentile(latencies, 99)
        out[f"{tenant}_p99_s"] = round(p99, 3) if p99 is not None else None
        p50 = percentile(latencies, 50)
        out[f"{tenant}_p50_s"] = round(p50, 3) if p50 is not None else None
    served = [r for r in records if r[3] and r[2] <= args.duration]
    tokens = sum(r[4] + r[5] for r in served)
    out["tokens_per_s"] = round(tokens / args.duration, 1)
    if name.startswith("backlog"):
        weight = 3.0 if name == "backlog-3to1" else 1.0
        windows = int(args.duration // args.window)
        per: list[dict[str, int]] = [{"flood": 0, "light": 0} for _ in range(windows)]
        for r in served:
            index = min(windows - 1, int(r[2] // args.window))
            per[index][r[0]] += r[4] + r[5]
        jains = [jain([w["flood"] / weight, w["light"]]) for w in per]
        ratios = [w["flood"] / w["light"] if w["light"] else None for w in per]
        out["window_tokens"] = json.dumps(per)
        out["jain_min"] = round(min(j for j in jains if j is not None), 3) if any(jains) else None
        found = [x for x in ratios if x is not None]
        out["ratio_min"] = round(min(found), 3) if found else None
        out["ratio_max"] = round(max(found), 3) if found else None
        # Both stayed backlogged: calls of each were still waiting at the end.
        out["backlogged"] = all(out.get(f"{t}_unfinished", 0) > 0 for t in ("flood", "light"))
    return out


# -- the invocation -------------------------------------------------------------------------------
def goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each goal of the issue, per run: the figure and whether it was met."""
    out: dict[str, Any] = {}
    for run in sorted({r["run"] for r in rows}):
        by = {r["leg"]: r for r in rows if r["run"] == run}
        solo = by.get("light-solo", {}).get("light_p99_s")
        for leg in ("fifo", "vllm-priority", "group-caps", "vtc", "vtc-2proc"):
            if leg in by and solo:
                out[f"run{run} {leg} light p99 / solo"] = round(by[leg]["light_p99_s"] / solo, 2)
        fifo = by.get("fifo", {}).get("tokens_per_s")
        for leg in ("vtc", "vtc-2proc", "group-caps"):
            if leg in by and fifo:
                out[f"run{run} {leg} tokens/s / fifo"] = round(by[leg]["tokens_per_s"] / fifo, 2)
        if "lone-group" in by and "lone-plain" in by:
            ratio = by["lone-group"]["tokens_per_s"] / by["lone-plain"]["tokens_per_s"]
            out[f"run{run} lone-group / lone-plain tokens/s"] = round(ratio, 2)
        for leg in ("backlog-equal", "backlog-2proc", "backlog-3to1"):
            if leg in by:
                out[f"run{run} {leg} jain min"] = by[leg].get("jain_min")
                out[f"run{run} {leg} flood/light tokens"] = (
                    f"{by[leg].get('ratio_min')}-{by[leg].get('ratio_max')}"
                )
    return out


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


@contextlib.contextmanager
def redis_at(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    sys.path.insert(0, str(ROOT))
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        say(f"redis-server at {server.url}")
        yield server.url


async def run_legs(
    names: Sequence[str], url: str, redis_url: str, args: argparse.Namespace, run: int,
    ref_dir: Path | None, record: Run, rows: list[dict[str, Any]],
) -> None:  # fmt: skip
    for name in names:
        say(f"run {run} {name} (load {loadavg()}) ...")
        before = loadavg()
        results = await run_leg(plan_leg(name, args, url, redis_url), ref_dir)
        row = {"run": run, "leg": name, **figures(name, results, args)}
        row["load"] = f"{before} -> {loadavg()}"
        say("  " + json.dumps({k: v for k, v in row.items() if k != "window_tokens"}))
        rows.append(row)
        record.add(**{k: v for k, v in row.items() if k not in ("run",)}, run=run)
        await asyncio.sleep(2.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.worker:
        print(json.dumps(asyncio.run(worker(json.loads(args.worker)))), flush=True)
        return
    names = [n for n in args.legs.split(",") if n]
    began = machine()
    record = Run.begin(
        "tenants",
        params={**{k: v for k, v in vars(args).items() if k != "worker"},
                "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN},
        peers=["openai", "redis"],
    )  # fmt: skip
    record.fact("legs", ABOUT)
    rows: list[dict[str, Any]] = []
    with (
        checkout(args.caps_ref) as ref_dir,
        redis_at(args.redis) as redis_url,
    ):
        with tiny_vllm(
            args.url, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
            wait_s=args.wait_for_others,
        ) as url:  # fmt: skip
            for run in range(1, args.runs + 1):
                order = names[run - 1 :] + names[: run - 1] if run > 1 else names
                # light-solo first in every run: the yardstick of the run.
                order = ["light-solo", *[n for n in order if n != "light-solo"]]
                asyncio.run(run_legs(order, url, redis_url, args, run, ref_dir, record, rows))
        if not args.no_priority and not args.url:
            with tiny_vllm(
                None, max_num_seqs=MAX_NUM_SEQS, max_model_len=MAX_MODEL_LEN,
                wait_s=args.wait_for_others, extra_args=("--scheduling-policy", "priority"),
            ) as url:  # fmt: skip
                for run in range(1, args.runs + 1):
                    legs = ["vllm-priority"]
                    asyncio.run(run_legs(legs, url, redis_url, args, run, ref_dir, record, rows))
    found = goals(rows)
    record.fact("goals", found)
    record.fact("caps_ref", args.caps_ref)
    path = record.save()
    print(json.dumps(found, indent=2))
    say(f"kept: {path} (started {began['when']})")


ABOUT = {
    "light-solo": "light alone, dsclient",
    "fifo": "both, one unbounded `openai.AsyncOpenAI` (the server's FIFO)",
    "vllm-priority": "both, unbounded openai, vLLM `--scheduling-policy priority`, light first",
    "group-caps": 'both, dsclient before tenants, `group_caps={"flood": 0.5}`',
    "vtc": "both, dsclient, `group=` per call (VTC)",
    "vtc-2proc": "both, one process each, `shared=` Redis (VTC across processes)",
    "backlog-equal": "both backlogged, equal weights",
    "backlog-3to1": 'both backlogged, `group_weights={"flood": 3}`',
    "backlog-2proc": "both backlogged, one process each, `shared=` Redis",
    "lone-group": 'flood alone, backlogged, `group="flood"`',
    "lone-plain": "flood alone, backlogged, no group (a single-tenant client)",
}

TABLE = (
    report_.Column("light p99 s", "light_p99_s", 2),
    report_.Column("light p50 s", "light_p50_s", 2),
    report_.Column("flood p99 s", "flood_p99_s", 1),
    report_.Column("tokens/s", "tokens_per_s", 0),
    report_.Column("Jain min", "jain_min", 3),
    report_.Column("flood/light tokens min", "ratio_min", 2),
    report_.Column("max", "ratio_max", 2),
)


def render(records: Sequence[dict[str, Any]]) -> str:
    """One line per leg (median and range over runs), then the goals as measured."""
    record = report_.latest(records)
    assert record is not None
    facts = record.get("facts", {})
    table = report_.leg_table(record["rows"], TABLE, about=facts.get("legs", ABOUT))
    found = facts.get("goals", {})
    lines = [f"- {key}: {value}" for key, value in found.items()]
    said = "Goals as measured (light p99 <= 1.2x solo; Jain >= 0.95 per window; flood/light 3 " \
        "+- 10% weighted; tokens/s >= 0.95x):\n\n" + "\n".join(lines) if lines else ""  # fmt: skip
    return "\n\n".join(p for p in (table, said, report_.conditions(record, records)) if p)


if __name__ == "__main__":
    main()
