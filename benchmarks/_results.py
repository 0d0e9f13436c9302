"""One benchmark invocation's results: recorded where they can be checked, kept in git.

    run = Run.begin("routing", params={"runs": 3, "seed": 7}, peers=["vllm-router"])
    run.add(leg="vllm-router cache_aware", run=1, makespan_s=12.4, short_p99_s=0.8)
    run.note("the slowed replica's engine shared a core with the router")
    path = run.save()   # benchmarks/results/routing/20261204T180102Z.json

:meth:`Run.begin` records, before anything is measured, what the figures depend on: the time
(UTC), the git commit and whether the tree differed from it (and which of dsclient's and the
benchmarks' files did), the Python, dsclient's and every named peer's installed version (``None``
when absent), the core count, the load average and the machine. :meth:`Run.add` appends one row
of figures (numbers, strings, booleans or ``None``: summaries, never traces); each row also gets
the 1-minute load average when it was added (``load_1min``). :meth:`Run.save` writes ONE small
JSON file per invocation, ``benchmarks/results/<benchmark>/<UTC stamp>.json``, which is tracked in
git; ``python -m benchmarks report`` renders the page's tables from those files.

Load, and a file already there, are read through :func:`load_records`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Where each benchmark's files go, one folder per benchmark (tracked in git).
RESULTS_ROOT = ROOT / "benchmarks" / "results"
#: The format of the files; bump when a field changes meaning.
SCHEMA = 1
#: A results file over this is a trace, not a summary: it is still written, with a warning.
MAX_BYTES = 50_000
#: The files whose changes matter to a figure: listed when the tree differs from the commit.
WATCHED = ("dsclient", "benchmarks", "pyproject.toml")

Scalar = int | float | str | bool | None


def _utc(now: dt.datetime) -> str:
    return now.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def installed(dist: str) -> str | None:
    """The installed version of distribution ``dist`` in this interpreter, or ``None``."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def git_state(root: Path = ROOT) -> dict[str, Any]:
    """The commit checked out, whether tracked files differ from it, and which watched ones do.

    ``dirty`` looks at tracked files only: the tree is shared, and others' untracked files do
    not change what runs. ``changed`` lists the differing (or untracked) paths under
    :data:`WATCHED`, at most 40. Outside a git checkout every field is ``None``.
    """

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *argv], cwd=root, capture_output=True, text=True, check=False, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"commit": None, "dirty": None, "changed": None}
    tracked = git("status", "--porcelain", "--untracked-files=no") or ""
    watched = git("status", "--porcelain", "--", *WATCHED) or ""
    changed = [line[3:] for line in watched.splitlines() if line.strip()]
    return {
        "commit": commit.strip(),
        "dirty": bool(tracked.strip()),
        "changed": changed[:40],
    }


def machine_facts() -> dict[str, Any]:
    """Cores, the CPU model, memory, the platform: what makes figures comparable between runs."""
    facts: dict[str, Any] = {
        "cores": os.cpu_count(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "node": platform.node(),
    }
    try:
        facts["cores_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        facts["cores_usable"] = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                facts["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    except OSError:
        pass
    return facts


def load_average() -> list[float]:
    """The 1, 5 and 15-minute load averages, rounded to 2 digits."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _check_figures(figures: Mapping[str, Any]) -> None:
    for key, value in figures.items():
        if not isinstance(value, int | float | str | bool) and value is not None:
            raise TypeError(
                f"figure {key!r} must be a number, string, bool or None, not "
                f"{type(value).__name__} (results are summaries, not traces)"
            )


@dataclasses.dataclass
class Run:
    """One invocation of a benchmark: its conditions (recorded first), rows, notes.

        run = Run.begin("shared", params={"runs": 3}, peers=["redis"])
        run.add(leg="static split", run=1, makespan_s=20.1)
        run.save()

    Build it with :meth:`begin`; the fields are what the JSON file holds.
    """

    benchmark: str
    started_utc: str
    params: dict[str, Any]
    code: dict[str, Any]
    versions: dict[str, str | None]
    host: dict[str, Any]
    load_before: list[float]
    rows: list[dict[str, Scalar]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)
    _now: Callable[[], dt.datetime] = dataclasses.field(
        default=lambda: dt.datetime.now(dt.timezone.utc), repr=False
    )
    _load: Callable[[], list[float]] = dataclasses.field(default=load_average, repr=False)

    @classmethod
    def begin(
        cls,
        benchmark: str,
        *,
        params: Mapping[str, Any] | None = None,
        peers: Iterable[str] = (),
        versions: Mapping[str, str | None] | None = None,
        now: Callable[[], dt.datetime] | None = None,
        load: Callable[[], list[float]] | None = None,
        code: Callable[[], dict[str, Any]] = git_state,
    ) -> Run:
        """Record the conditions of a run about to start.

        ``peers`` are distribution names looked up in this interpreter (``"litellm"``,
        ``"vllm-router"``); ``versions`` adds ones found elsewhere (the vLLM of the server's
        own venv). ``now``, ``load`` and ``code`` are for tests.
        """
        if not benchmark or "/" in benchmark or benchmark.startswith("."):
            raise ValueError(f"benchmark must be a plain name, got {benchmark!r}")
        clock = now or (lambda: dt.datetime.now(dt.timezone.utc))
        loads = load or load_average
        found: dict[str, str | None] = {"dsclient": installed("dsclient")}
        found.update((name, installed(name)) for name in peers)
        found.update(versions or {})
        return cls(
            benchmark=benchmark,
            started_utc=_utc(clock()),
            params=dict(params or {}),
            code=code(),
            versions=found,
            host={"python": sys.version.split()[0], **machine_facts()},
            load_before=loads(),
            _now=clock,
            _load=loads,
        )

    def add(self, *, leg: str, run: int, **figures: Scalar) -> dict[str, Scalar]:
        """Append one row: ``leg`` (the peer with its settings), ``run`` (from 1), figures.

        The row also gets ``load_1min``, the load average as it is added (unless given).
        """
        _check_figures(figures)
        row: dict[str, Scalar] = {"leg": leg, "run": run, **figures}
        if "load_1min" not in row:
            row["load_1min"] = (self._load() or [None])[0]
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        """Something a reader needs beside the figures (a failure seen, a workaround used)."""
        self.notes.append(text)

    def abort(self, reason: str, root: Path | None = None) -> Path | None:
        """Keep an invocation that stopped early: the ``aborted`` fact says why, the rows so
        far stay (the report marks it stale, never pools it). Nothing is kept for a run that
        had no row yet: it is as if it had not started. Returns the path, or ``None``."""
        if not self.rows:
            return None
        self.facts["aborted"] = reason[:300]
        return self.save(root)

    @contextlib.contextmanager
    def kept_if_aborted(self, root: Path | None = None) -> Iterator[None]:
        """Inside the block, an exception (Ctrl-C, a kill, a crash) saves the run through
        :meth:`abort` with its reason, then goes on."""
        try:
            yield
        except BaseException as exc:
            path = self.abort(f"{type(exc).__name__}: {exc}".rstrip(": "), root)
            if path is not None:
                print(f"kept the aborted run in {path}", file=sys.stderr)
            raise

    def fact(self, key: str, value: Any) -> None:
        """A condition learnt during the run (the server's version, its flags): JSON values."""
        json.dumps(value)  # fails here rather than at save
        self.facts[key] = value

    def payload(self) -> dict[str, Any]:
        """What :meth:`save` writes."""
        return {
            "schema": SCHEMA,
            "benchmark": self.benchmark,
            "started_utc": self.started_utc,
            "finished_utc": _utc(self._now()),
            "code": self.code,
            "versions": self.versions,
            "host": self.host,
            "load_before": self.load_before,
            "load_after": self._load(),
            "params": self.params,
            "facts": self.facts,
            "notes": self.notes,
            "rows": self.rows,
        }

    def save(self, root: Path | None = None) -> Path:
        """Write ``<root>/<benchmark>/<UTC stamp of the start>.json``; return its path.

        Two invocations started in the same second get ``-2``, ``-3`` ... A file over
        :data:`MAX_BYTES` is written anyway (the run is not lost) with a warning.
        """
        folder = (root or RESULTS_ROOT) / self.benchmark
        folder.mkdir(parents=True, exist_ok=True)
        stamp = self.started_utc.replace("-", "").replace(":", "")
        path, n = folder / f"{stamp}.json", 1
        while path.exists():
            n += 1
            path = folder / f"{stamp}-{n}.json"
        text = json.dumps(self.payload(), indent=1, sort_keys=False) + "\n"
        path.write_text(text)
        if len(text.encode()) > MAX_BYTES:
            warnings.warn(
                f"{path} is {len(text.encode())} bytes (over {MAX_BYTES}): keep summaries only",
                stacklevel=2,
            )
        return path


def _order(path: Path) -> tuple[str, int]:
    stamp, _, n = path.stem.partition("-")
    return stamp, int(n) if n.isdigit() else 1


def load_records(benchmark: str, root: Path | None = None) -> list[dict[str, Any]]:
    """Every saved invocation of ``benchmark``, oldest first (by file name: the UTC stamp)."""
    folder = (root or RESULTS_ROOT) / benchmark
    if not folder.is_dir():
        return []
    records = []
    for path in sorted(folder.glob("*.json"), key=_order):
        record = json.loads(path.read_text())
        record["_file"] = path.name
        records.append(record)
    return records


def benchmarks_with_results(root: Path | None = None) -> list[str]:
    """The benchmarks that have at least one saved file, sorted."""
    base = root or RESULTS_ROOT
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.is_dir() and any(p.glob("*.json")))
