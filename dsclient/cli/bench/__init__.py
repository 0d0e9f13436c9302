"""``dsclient bench``: a stepped load test of a server, its knee, and where dsclient's limit ends.

    dsclient bench http://127.0.0.1:8000 -o bench-out        # closed loop at 1, 2, 3, 4, 5, 6 ...
    dsclient bench http://127.0.0.1:8000 --slo-p99 2 --max-steps 12 --json
    dsclient bench http://127.0.0.1:8000 --rates 1,2,4,8,16  # open loop, Poisson arrivals

Closed loop: each step runs a fixed number of workers (the step's concurrency) for
``--step-seconds``, each sending one streamed request after another straight to the server (bare
httpx, no governor); the concurrency grows by ``--factor`` a step, at least by one. Open loop
(``--rates``): requests arrive as a Poisson process at each rate in turn, however many are in
flight. Then one more phase of ``--step-seconds`` drives the same workload through
``dsclient.AsyncClient`` and reports the limit its governor ended at.

Metrics are those of ``vllm bench serve``, so the numbers compare:

* TTFT: from sending the request to the first streamed chunk that carries text.
* TPOT: ``(latency - TTFT) / (output tokens - 1)``, per request, for requests of 2+ tokens.
* ITL: the gaps between successive text chunks, pooled over the step's requests.
* output tokens: the server's ``usage.completion_tokens`` (``stream_options.include_usage``),
  else the number of text chunks.
* throughput: successful requests (and their output tokens) over the step's wall time, from its
  start until its last request finished (requests started before the end are waited for, as
  ``vllm bench serve`` does).
* goodput (``--goodput ttft:MS,tpot:MS``): successful requests that met every objective given,
  per second of the step, as ``vllm bench serve --goodput`` counts them (:mod:`.goodput`).
* percentiles: linear interpolation between the two nearest ranks (numpy's default, which
  ``vllm bench serve`` uses).

The policy is pure and tested on its own: :func:`concurrency_schedule` (the steps),
:func:`stop_reason` (when to stop early), :func:`find_knee` (the knee), :func:`percentile`,
:func:`summarize_step` (one step's figures from its requests) and :func:`governor_workers`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import random
import sys
import textwrap
from pathlib import Path
from typing import IO, Any

import anyio

from ..._http import httpx, transport_for
from .._common import add_url, given_url
from .goodput import Slo, parse_goodput
from .policy import (
    DEFAULT_TOKENS_PER_WORD,
    KNEE_FRACTION,
    Knee,
    Mode,
    RequestSample,
    StepResult,
    concurrency_schedule,
    find_knee,
    governor_workers,
    next_concurrency,
    percentile,
    stop_reason,
    summarize_load,
    summarize_step,
)
from .report import _bound_reason, summary_text, write_outputs
from .runner import Bench, Unreachable, _find_model, _one_line, _tokens_per_word
from .workload import BenchRequest, SyntheticMix, _cycle, load_workload_file, prompt_of

__all__ = [
    "DEFAULT_TOKENS_PER_WORD",
    "KNEE_FRACTION",
    "BenchRequest",
    "Knee",
    "RequestSample",
    "Slo",
    "StepResult",
    "SyntheticMix",
    "add_bench_parser",
    "concurrency_schedule",
    "find_knee",
    "governor_workers",
    "load_workload_file",
    "main",
    "next_concurrency",
    "parse_goodput",
    "percentile",
    "prompt_of",
    "run",
    "stop_reason",
    "summarize_load",
    "summarize_step",
]


_DESCRIPTION = textwrap.fill(
    "Load-test the server at URL in steps: closed loop from --start workers, times --factor each"
    " step (at least +1), or open loop at the Poisson --rates. Each step reports requests and"
    " output tokens per second, TTFT / TPOT / ITL (as vllm bench serve defines them), latency"
    " percentiles, errors, and the server's running / waiting / KV usage from /metrics. It stops"
    " when throughput stops rising while p99 climbs, on errors, or at a bound; then reports the"
    " knee and the limit dsclient's governor settles at against the same workload.",
    width=78,
)
_EPILOG = (
    "examples:\n"
    "  dsclient bench http://127.0.0.1:8000 -o bench-out\n"
    "  dsclient bench http://127.0.0.1:8000 --slo-p99 1.5 --max-steps 10 --step-seconds 5\n"
    "  dsclient bench http://127.0.0.1:8000 --rates 1,2,4,8 --workload requests.jsonl --json\n"
    "  dsclient bench http://127.0.0.1:8000 --rates 2,4,8 --goodput ttft:500,tpot:50\n"
    "knee without --slo-p99: the last step beyond which one more request in flight buys less\n"
    f"than {KNEE_FRACTION:.0%} of the throughput the first step bought per request in flight.\n"
    "exit status: 0 done, 1 every request failed, 2 bad arguments or server unreachable,\n"
    "130 interrupted (what was measured is still written)"
)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _goodput(text: str) -> Slo:
    try:
        return parse_goodput(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rates(text: str) -> list[float]:
    rates = [_positive_float(part) for part in text.split(",") if part.strip()]
    if not rates:
        raise argparse.ArgumentTypeError("give at least one rate, e.g. 1,2,4")
    return rates


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench`` to an ``argparse`` subparsers object; sets ``func=run``."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="load-test a server in steps; report its knee and dsclient's limit",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=run)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    add_url(parser)
    parser.add_argument("--model", help="the model to ask for (default: the server's only one)")
    steps = parser.add_argument_group("steps")
    steps.add_argument("--start", type=_positive_int, default=1, help="first concurrency (1)")
    steps.add_argument(
        "--factor", type=_positive_float, default=1.2, help="concurrency growth per step (1.2)"
    )
    steps.add_argument(
        "--max-concurrency", type=_positive_int, default=256, help="last concurrency (256)"
    )
    steps.add_argument(
        "--step-seconds", type=_positive_float, default=10.0, help="seconds per step (10)"
    )
    steps.add_argument("--max-steps", type=_positive_int, default=None, help="at most N steps")
    steps.add_argument(
        "--rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="open loop: Poisson arrivals at these requests/s, one step each",
    )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--workload",
        default="synthetic",
        metavar="synthetic|FILE.jsonl",
        help="the synthetic short/long mix (default), or a JSONL file of requests",
    )
    work.add_argument("--short-ratio", type=float, default=0.75, help="share of short requests")
    work.add_argument("--short-prompt-tokens", type=_positive_int, default=64)
    work.add_argument("--long-prompt-tokens", type=_positive_int, default=1000)
    work.add_argument("--short-output", type=_positive_int, default=64, help="max_tokens, short")
    work.add_argument("--long-output", type=_positive_int, default=256, help="max_tokens, long")
    work.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send vLLM's ignore_eos (outputs may then end early)",
    )
    work.add_argument("--seed", type=int, default=0, help="random seed of prompts and arrivals")
    report = parser.add_argument_group("report")
    report.add_argument(
        "--slo-p99", type=_positive_float, default=None, help="knee: best throughput with p99 <= S"
    )
    report.add_argument(
        "--knee-fraction",
        type=_positive_float,
        default=KNEE_FRACTION,
        help=f"knee without an SLO: marginal share of the first step's gain ({KNEE_FRACTION})",
    )
    report.add_argument(
        "--goodput",
        type=_goodput,
        default=None,
        metavar="ttft:MS,tpot:MS",
        help="report goodput: requests/s meeting every objective (ms; ttft, tpot, e2el), as"
        " vllm bench serve --goodput counts them",
    )
    report.add_argument("--timeout", type=_positive_float, default=600.0, help="per request (s)")
    report.add_argument(
        "--no-governor", dest="governor", action="store_false", help="skip the governor phase"
    )
    report.add_argument("-o", "--output", metavar="DIR", help="write bench.json and bench.png here")
    report.add_argument("--json", action="store_true", help="print bench.json instead of a table")


def run(
    args: argparse.Namespace,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run ``dsclient bench``; see the module's docstring for the exit statuses."""
    from ..._urls import root_url

    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr

    def fail(message: str, code: int = 2) -> int:
        print(f"dsclient bench: {message}", file=err, flush=True)
        return code

    try:
        url = root_url(given_url(args))
        if args.factor <= 1:
            raise ValueError(f"--factor must be > 1, got {args.factor:g}")
        if args.max_concurrency < args.start:
            raise ValueError(
                f"--max-concurrency ({args.max_concurrency}) is below --start ({args.start})"
            )
        mix = SyntheticMix(
            short_ratio=args.short_ratio,
            short_prompt_tokens=args.short_prompt_tokens,
            long_prompt_tokens=args.long_prompt_tokens,
            short_output=args.short_output,
            long_output=args.long_output,
        )
        file_requests = None
        if args.workload != "synthetic":
            file_requests = load_workload_file(args.workload, default_max_tokens=args.long_output)
    except (ValueError, TypeError) as exc:
        return fail(_one_line(str(exc)))
    except OSError as exc:
        return fail(f"cannot read {args.workload}: {exc.strerror}")
    if args.output:  # before the run, not after minutes of it
        try:
            Path(args.output).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return fail(f"cannot create {args.output}: {exc.strerror}")
    mode: Mode = "open" if args.rates else "closed"
    loads: list[float]
    if args.rates:
        loads = list(args.rates[: args.max_steps] if args.max_steps else args.rates)
    else:
        loads = [
            float(c)
            for c in concurrency_schedule(
                args.start, args.factor, args.max_concurrency, args.max_steps
            )
        ]
    report: dict[str, Any] = {
        "url": url,
        "model": args.model,
        "mode": mode,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            key: value
            for key, value in vars(args).items()
            if key not in ("func", "extra_args", "verbose", "url", "url_option", "goodput")
            and not callable(value)
        }
        | {"goodput": args.goodput.text() if args.goodput is not None else None},
        "workload": {"kind": "synthetic", **dataclasses.asdict(mix)}
        if file_requests is None
        else {"kind": "file", "path": args.workload, "requests": len(file_requests)},
        "steps": [],
        "stop": None,
        "knee": None,
        "governor": None,
    }
    state: dict[str, Any] = {}

    async def main_async() -> None:
        http = httpx.AsyncClient(
            transport=transport_for("aiohttp", transport),
            timeout=httpx.Timeout(args.timeout, connect=min(args.timeout, 10.0)),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
            headers={"User-Agent": "dsclient-bench/0.1"},
        )
        async with http:
            model, max_model_len = await _find_model(http, url, args.model)
            report["model"] = model
            report["max_model_len"] = max_model_len
            rng = random.Random(args.seed)
            if file_requests is None:
                per_word, source = await _tokens_per_word(http, url, model)
                report["workload"].update(
                    tokens_per_word=round(per_word, 3), tokens_per_word_source=source
                )
                requests = mix.requests(rng, per_word, ignore_eos=args.ignore_eos)
            else:
                requests = _cycle(file_requests)
            bench = Bench(
                http,
                url,
                model=model,
                requests=requests,
                step_seconds=args.step_seconds,
                rng=random.Random(args.seed + 1),
                progress=err,
                slo=args.goodput,
            )
            state["bench"] = bench
            what = "closed loop" if mode == "closed" else "open loop"
            print(
                f"dsclient bench: {url} model {model}, {what}, {len(loads)} steps at most of"
                f" {args.step_seconds:g} s",
                file=err,
                flush=True,
            )
            stop = await bench.sweep(mode=mode, loads=loads)
            if stop[0] == "bound":
                stop = _bound_reason(mode, loads, args.max_concurrency, args.max_steps)
            state["stop"] = stop
            knee = find_knee(bench.steps, slo_p99=args.slo_p99, fraction=args.knee_fraction)
            state["knee"] = knee
            if args.governor and bench.steps and bench.steps[0].requests:
                state["governor"] = await bench.governor(knee, args.max_concurrency, transport)

    code = 0
    try:
        anyio.run(main_async)
    except Unreachable as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        state.setdefault("stop", ("interrupted", "Ctrl-C (during the sweep)"))
        if "knee" in state:
            print("dsclient bench: governor phase interrupted", file=err, flush=True)
        code = 130
    bench_done: Bench | None = state.get("bench")
    steps = bench_done.steps if bench_done is not None else []
    if not steps:
        return fail("interrupted before the first step ended", code or 1)
    report["steps"] = [s.to_dict() for s in steps]
    reason, detail = state.get("stop", ("interrupted", "Ctrl-C"))
    report["stop"] = {"reason": reason, "detail": detail}
    knee = state.get("knee") or find_knee(steps, slo_p99=args.slo_p99, fraction=args.knee_fraction)
    report["knee"] = knee.to_dict()
    report["governor"] = state.get("governor")
    notes: list[str] = []
    if args.output:
        try:
            notes = write_outputs(report, Path(args.output))
        except OSError as exc:
            return fail(f"cannot write {args.output}: {exc.strerror}", 1)
    if args.json:
        print(json.dumps(report, indent=2), file=out, flush=True)
    else:
        print(summary_text(report), file=out, flush=True)
    for note in notes:
        print(f"dsclient bench: {note}", file=err, flush=True)
    if code == 0 and all(s.requests == 0 for s in steps):
        return fail(f"every request failed ({steps[0].first_error})", 1)
    return code


def main(argv: list[str] | None = None) -> int:
    """``python -m dsclient.cli.bench URL ...``: the command on its own."""
    parser = argparse.ArgumentParser(
        prog="dsclient bench",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))
