"""One batch job on Ray Data, two ways: dsclient's callable class against Ray's own HTTP processor.

    python -m benchmarks ray                          # launches the tiny vLLM; three runs
    python -m benchmarks ray --url http://127.0.0.1:8000 --runs 1 --rows 200 --qps 10,40

The job: ``--rows`` (400) prompts of ~16 words, plus ``--overlong`` (4) prompts longer than the
context, each answered with 32 tokens (``ignore_eos``) by the tiny random Llama on vLLM
(``max_num_seqs`` 8, launched by dsclient's launcher unless ``--url`` is given), through
``map_batches`` on a local Ray (``ray.init(num_cpus=2)``) with a pool of ``--actors`` (2) actors
and batches of ``--batch-size`` (64). Legs, run one after the other in each run, in an order that
rotates between runs:

* ``dsclient``: :func:`dsclient.ray.map_dataset` (one ``AsyncClient`` per actor, its closed loop
  on the server's ``/metrics``);
* ``dsclient-shared``: the same with ``shared=`` a real redis-server started for the run (one
  budget for both actors); left out when ``redis-server`` is not on PATH;
* ``ray-http-qpsN`` for each N of ``--qps`` (10,40): ``ray.data.llm``'s
  ``HttpRequestProcessorConfig`` (Ray's documented way to call an OpenAI-compatible server from
  Ray Data) with ``qps=N`` per actor, ``max_retries=3`` and ``base_retry_wait_time_in_s=1``
  (``1 x 2^n`` s, no jitter, no ``Retry-After``), ``concurrency=(actors, actors)`` (a fixed
  pool; a plain ``concurrency=2`` is an autoscaling pool of 1 to 2 actors). ``qps`` is not a
  rate per actor over the job: the stage's ``udf`` resets its clock and count at every batch
  (``start_time``, ``request_count``);
* ``ray-http-actorsN`` for each N of ``--wide`` (8 = ``max_num_seqs``): the same processor with
  ``concurrency=(N, N)``, no ``qps``, and ``--batch-size`` cut so that every actor gets work:
  as many requests in flight as the server runs at once. The input is ``--blocks`` (8) blocks
  for every leg: with Ray's default (about 200 blocks of 2 rows here) the processor's
  ``Map(_preprocess)`` stage ran one task at a time under Ray Data's resource budget and the
  8 actors had 1-2 batches in flight (``Tasks: 2; Actors: 8`` in Ray's progress log).

* ``ray-gatherN`` for each N of ``--gather`` (16 = 2x ``max_num_seqs``, the headline's best
  fixed semaphore): plain ``map_batches`` with a callable class, as Ray Data's docs write one,
  on the same ``--actors`` actors as dsclient's legs; each batch is an ``asyncio.gather`` of
  httpx POSTs behind a semaphore of ``N / actors``, so up to N requests are in flight over the
  pool: Ray at its best without ``ray.data.llm``'s one-at-a-time processor.

**Why Ray's processor has one request in flight per actor** (ray 2.60.0,
``ray/llm/_internal/batch/stages/http_request_stage.py``, ``HttpRequestUDF.udf``): the first loop
builds ``request = session.post(...)`` for every row ("Create request but don't await it yet");
aiohttp sends nothing until that object is awaited, and the second loop awaits them one at a
time (``async with await request as response``), each to its end before the next. So each actor
sends its batch one request after another whatever ``qps`` says, and the only way to more in
flight is more actors.

Per leg: makespan (from submitting the job to the last row, Ray's actor start-up included, alike
for every leg), failures (rows with an error; a job that raised is reported as such), and the
server's own load polled from ``/metrics`` every 0.2 s: ``vllm:num_requests_waiting`` (its queue:
mean, p90, max) and ``vllm:num_requests_running`` (its batch). The machine's load (``uptime``)
is recorded before and after each run. Raw results: ``benchmarks/results/ray.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _report as report_
from benchmarks._common import (
    ROOT,
    default_placement,
    engine_sampler,
    machine,
    placement_facts,
    say,
    server_group,
    tiny_vllm,
    words,
    write_results,
)
from benchmarks._results import Run

MAX_TOKENS = 32
MODEL = "tiny"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def _rows(n: int, overlong: int, rng: random.Random) -> list[dict[str, Any]]:
    rows = [{"id": i, "prompt": words(rng, 16)} for i in range(n)]
    for k in range(overlong):  # spread through the job; each far over the 2048-token context
        rows.insert((k + 1) * n // (overlong + 1), {"id": n + k, "prompt": words(rng, 3000)})
    return rows


@contextmanager
def _redis() -> Iterator[str | None]:
    """A real redis-server for the shared leg, or ``None`` when it is not installed."""
    try:
        from tests.redis_server import RedisServer

        server = RedisServer()
    except (ImportError, RuntimeError) as exc:
        say(f"no shared leg: {exc}")
        yield None
        return
    with server:
        yield server.url


def blocks(args: Any) -> dict[str, int]:
    """``from_items``' block count for every leg (``--blocks``; 0 leaves Ray's default)."""
    return {"override_num_blocks": args.blocks} if args.blocks else {}


def _dsclient_leg(
    url: str, rows: list[dict[str, Any]], args: Any, **options: Any
) -> Callable[[], Any]:
    def run() -> list[dict[str, Any]]:
        import ray

        from dsclient.ray import map_dataset

        ds = ray.data.from_items(rows, **blocks(args))
        out = map_dataset(
            ds,
            url,
            actors=args.actors,
            batch_size=args.batch_size,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            columns={"queued_s": None},
            **options,
        )
        return [{"id": r["id"], "error": r["error"]} for r in out.take_all()]

    return run


def _ray_http_leg(
    url: str, rows: list[dict[str, Any]], args: Any, qps: int | None, actors: int | None = None
) -> Callable[[], Any]:
    actors = actors or args.actors
    # every actor gets a batch: the rows split evenly, never more than --batch-size
    batch_size = min(args.batch_size, max(1, -(-len(rows) // actors)))

    def run() -> list[dict[str, Any]]:
        import ray
        from ray.data.llm import HttpRequestProcessorConfig, build_processor

        config = HttpRequestProcessorConfig(
            url=f"{url}/v1/completions",
            qps=qps,
            max_retries=3,
            base_retry_wait_time_in_s=1,
            # (n, n): a fixed pool of n actors, as dsclient's legs have; a plain n would be an
            # autoscaling pool of 1 to n (ray/llm/_internal/batch/processor/utils.py).
            concurrency=(actors, actors),
            batch_size=batch_size,
            # One of the two CPUs Ray is given, shared by the pool (2 actors: 0.5 each, as
            # dsclient's legs ask for). The other stays free for the processor's pre- and
            # postprocess tasks: with 8 actors at 0.25 the pool took both and preprocess waited
            # for ever ("backpressured:tasks(ResourceBudget)").
            http_request_stage={"num_cpus": 1 / actors},
        )

        # Closures, so that Ray pickles them by value (workers need not import this module).
        def pre(row: dict[str, Any]) -> dict[str, Any]:
            return {
                "payload": {
                    "model": MODEL,
                    "prompt": row["prompt"],
                    "max_tokens": MAX_TOKENS,
                    "ignore_eos": True,
                }
            }

        def post(row: dict[str, Any]) -> dict[str, Any]:
            answer = row["http_response"]
            error = answer.get("error") if isinstance(answer, dict) else "no answer"
            if isinstance(error, dict):
                error = error.get("message", str(error))
            return {"id": row["id"], "error": error or None}

        processor = build_processor(config, preprocess=pre, postprocess=post)
        return list(processor(ray.data.from_items(rows, **blocks(args))).take_all())

    return run


def gather_split(in_flight: int, actors: int) -> int:
    """Each actor's semaphore in the ``ray-gatherN`` leg: ``N`` in flight over the pool."""
    return max(1, in_flight // max(1, actors))


def _ray_gather_leg(
    url: str, rows: list[dict[str, Any]], args: Any, in_flight: int
) -> Callable[[], Any]:
    """Plain Ray Data as its docs write a callable class for ``map_batches``, each batch sent as
    an ``asyncio.gather`` of httpx POSTs behind a semaphore: ``in_flight`` over the pool (the
    headline's best fixed setting is 2x max_num_seqs), ``--actors`` actors like dsclient's."""
    actors = args.actors
    per_actor = gather_split(in_flight, actors)
    batch_size = min(args.batch_size, max(1, -(-len(rows) // actors)))

    class Gather:
        def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
            import httpx

            async def send_all() -> list[str | None]:
                gate = asyncio.Semaphore(per_actor)
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
                async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:

                    async def one(prompt: str) -> str | None:
                        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                "ignore_eos": True}  # fmt: skip
                        async with gate:
                            try:
                                answer = await http.post(url + "/v1/completions", json=body)
                            except httpx.HTTPError as exc:
                                return type(exc).__name__
                        return None if answer.status_code == 200 else f"HTTP {answer.status_code}"

                    return list(await asyncio.gather(*(one(str(p)) for p in batch["prompt"])))

            errors = asyncio.run(send_all())
            return {"id": batch["id"], "error": [e or "" for e in errors]}

    def run() -> list[dict[str, Any]]:
        import ray

        ds = ray.data.from_items(rows, **blocks(args))
        out = ds.map_batches(
            Gather, concurrency=(actors, actors), batch_size=batch_size, num_cpus=1 / actors
        )
        return [{"id": int(r["id"]), "error": r["error"] or None} for r in out.take_all()]

    return run


async def _leg(name: str, url: str, run: Callable[[], Any], n: int) -> dict[str, Any]:
    say(f"  {name} ...")
    async with engine_sampler(url, every=0.2) as engine:
        started = time.perf_counter()
        try:
            rows = await asyncio.to_thread(run)
        except Exception as exc:  # Ray's processor raises once a row runs out of retries
            rows, job_error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        else:
            job_error = None
        makespan = time.perf_counter() - started
    found: dict[str, Any] = {"leg": name, "makespan_s": round(makespan, 2), **engine}
    if rows is None:
        found.update(job_failed=job_error, rows=0, failures=None)
    else:
        ids = sorted(r["id"] for r in rows)
        found.update(
            rows=len(rows),
            every_row_once=ids == list(range(n)),
            failures=sum(1 for r in rows if r["error"] is not None),
            errors=sorted({str(r["error"])[:80] for r in rows if r["error"] is not None})[:3],
        )
    say(
        f"    {found['makespan_s']} s, failures {found.get('failures')}, queue p90 "
        f"{found.get('waiting_p90')} (max {found.get('waiting_max')}), running mean "
        f"{found.get('running_mean')}" + (f", JOB FAILED: {job_error}" if job_error else "")
    )
    return found


async def _run_once(url: str, args: Any, redis_url: str | None, index: int) -> dict[str, Any]:
    rng = random.Random(1000 + index)
    rows = _rows(args.rows, args.overlong, rng)
    n = len(rows)
    legs: list[tuple[str, Callable[[], Any]]] = [("dsclient", _dsclient_leg(url, rows, args))]
    if redis_url is not None:
        legs.append(
            (
                "dsclient-shared",
                _dsclient_leg(url, rows, args, shared=redis_url, shared_key=f"bench-{index}"),
            )
        )
    legs += [(f"ray-http-qps{q}", _ray_http_leg(url, rows, args, q)) for q in args.qps]
    legs += [(f"ray-http-actors{w}", _ray_http_leg(url, rows, args, None, w)) for w in args.wide]
    legs += [(f"ray-gather{g}", _ray_gather_leg(url, rows, args, g)) for g in args.gather]
    shift = index % len(legs)  # rotate the order between runs
    legs = legs[shift:] + legs[:shift]
    before = _uptime()
    results = [await _leg(name, url, run, n) for name, run in legs]
    after = _uptime()
    base = next(r for r in results if r["leg"] == "dsclient")
    for r in results:
        if r["makespan_s"] and base["makespan_s"]:
            r["makespan_vs_dsclient"] = round(r["makespan_s"] / base["makespan_s"], 2)
    return {"run": index + 1, "uptime_before": before, "uptime_after": after, "legs": results}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks ray", description=__doc__)
    parser.add_argument("--url", help="a running vLLM serving 'tiny' (default: launch one)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--overlong", type=int, default=4)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--qps",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[40],
        help="Ray HTTP processor legs with --actors actors: qps, comma-separated (default 40;"
        " empty: none)",
    )
    parser.add_argument(
        "--wide",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8],
        help="Ray HTTP processor legs with this many actors and no qps (default 8)",
    )
    parser.add_argument(
        "--gather",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[16],
        help="map_batches legs: a callable class gathering each batch with this many in flight"
        " over the --actors actors (default 16 = 2x max_num_seqs; empty: none)",
    )
    parser.add_argument("--no-shared", action="store_true", help="leave out the Redis leg")
    parser.add_argument("--no-save", action="store_true", help="keep no results file (a try-out)")
    parser.add_argument(
        "--blocks",
        type=int,
        default=8,
        help="blocks of the input dataset, every leg (0: Ray's default, about one per 2 rows"
        " here, which left the HTTP processor's preprocess stage feeding 8 actors 1-2 batches)",
    )
    parser.add_argument("--wait-for-others", type=float, metavar="SECONDS",
                        help="wait at most this long for other vLLMs to stop (default: for ever)")
    args = parser.parse_args()

    import ray

    record = Run.begin(
        "ray",
        params={
            **{k: v for k, v in vars(args).items() if k != "no_save"},
            "max_num_seqs": 8,
            "max_tokens": MAX_TOKENS,
            "ray_num_cpus": 2,
        },
        peers=["ray"],
    )
    record.fact("legs", {
        "dsclient": f"`dsclient.ray.map_dataset`, {args.actors} actors",
        "dsclient-shared": f"the same with `shared=` Redis ({args.actors} actors, one budget)",
        **{f"ray-http-qps{q}": f"`ray.data.llm` HTTP processor, {args.actors} actors, qps={q}"
           for q in args.qps},
        **{f"ray-http-actors{w}": f"`ray.data.llm` HTTP processor, {w} actors, no qps"
           for w in args.wide},
        **{f"ray-gather{g}": f"`map_batches` with a callable class, {args.actors} actors, each "
           f"batch an `asyncio.gather` of httpx POSTs, {g} in flight over the pool"
           for g in args.gather},
    })  # fmt: skip
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's workers import dsclient from the venv; this checkout's `tests` (for redis_server)
    # is only needed in this process.
    sys.path.insert(0, str(ROOT))
    placement = default_placement()
    # vLLM on the server's CPUs; Redis and Ray's processes start after it, on the client's.
    with (
        tiny_vllm(
            args.url, max_num_seqs=8, max_model_len=2048, wait_s=args.wait_for_others,
            placement=placement,
        ) as url,
        _redis() if not args.no_shared else _none() as redis_url,
    ):
        record.fact("placement", placement_facts(placement, [server_group(url)]))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            runs = [asyncio.run(_run_once(url, args, redis_url, i)) for i in range(args.runs)]
        finally:
            ray.shutdown()
    payload = {
        "benchmark": "ray",
        "machine": machine(),
        "ray": ray.__version__,
        "settings": {
            "rows": args.rows,
            "overlong": args.overlong,
            "actors": args.actors,
            "batch_size": args.batch_size,
            "qps_per_actor": args.qps,
            "max_tokens": MAX_TOKENS,
            "max_num_seqs": 8,
        },
        "runs": runs,
    }
    path = write_results("ray", payload)
    for run in runs:
        for leg in run["legs"]:
            record.add(leg=leg["leg"], run=run["run"], **kept(leg))
    say(f"results: {path}" + ("" if args.no_save else f"; kept: {record.save()}"))
    for run in runs:
        say(f"run {run['run']}: {run['uptime_before']}")
        for leg in run["legs"]:
            say(
                f"  {leg['leg']:18} {leg['makespan_s']:7.1f} s  x{leg.get('makespan_vs_dsclient')}"
                f"  failures {leg.get('failures')}  queue p90 {leg.get('waiting_p90')}"
                f"  max {leg.get('waiting_max')}  running {leg.get('running_mean')}"
                + (f"  JOB FAILED {leg['job_failed']}" if leg.get("job_failed") else "")
            )


@contextmanager
def _none() -> Iterator[None]:
    yield None


def kept(leg: dict[str, Any]) -> dict[str, Any]:
    """A leg's summary as :meth:`Run.add` keeps it."""
    keys = ("makespan_s", "rows", "failures", "every_row_once", "running_mean", "waiting_mean",
            "waiting_p90", "waiting_max", "job_failed")  # fmt: skip
    found = {key: leg.get(key) for key in keys}
    if leg.get("errors"):
        found["first_error"] = str(leg["errors"][0])[:120]
    return found


TABLE = (
    report_.Column("makespan s", "makespan_s", 1),
    report_.Column("failed rows", "failures", 0),
    report_.Column("engine batch mean", "running_mean", 1),
    report_.Column("server queue p90", "waiting_p90", 1),
)


def render(records: Sequence[dict[str, Any]]) -> str:
    """One line per leg: makespan, failures, what the server ran; median (range) over runs."""
    record = report_.latest(records)
    assert record is not None
    about = record.get("facts", {}).get("legs")
    table = report_.leg_table(record["rows"], TABLE, about=about)
    params = record.get("params", {})
    n = params.get("blocks")
    setup = (
        f"{params.get('rows')} rows and {params.get('overlong')} over the context; the input in "
        + (f"{n} blocks" if n else "Ray's default blocks (`--blocks 0`)")
        + f"; batches of at most {params.get('batch_size')}."
    )
    return table + "\n\n" + setup + "\n\n" + report_.conditions(record, records)


def headline(records: Sequence[dict[str, Any]]) -> list[report_.Versus]:
    """dsclient over each Ray HTTP processor leg, per run: the job's makespan."""
    record = report_.latest(records)
    if record is None:
        return []
    rows = record["rows"]
    return [
        report_.Versus("ray", peer, "makespan", found, "job")
        for peer in report_.legs(rows)
        if peer.startswith(("ray-http", "ray-gather"))
        and (found := report_.ratios(rows, "makespan_s", peer))
    ]


if __name__ == "__main__":
    main()
