"""``python -m benchmarks report``: the tables of ``docs/benchmarks.md``, from the kept results.

    python -m benchmarks report            # rewrite the generated blocks of docs/benchmarks.md
                                           # docs/index.md and README.md (``home`` blocks)
    python -m benchmarks report --check    # exit 1 if the page is not what the results give

The page holds blocks between markers, each rewritten whole and nothing else touched::

    <!-- BEGIN generated: headline-table -->   the table the page opens with
    <!-- BEGIN generated: routing -->          one per benchmark with results
    <!-- END generated: routing -->

A benchmark's block comes from its module's ``render(records)``: ``records`` are its saved files
(:func:`benchmarks._results.load_records`, oldest first), and ``render`` returns markdown. The
helpers here make that a few lines::

    def render(records):
        return report.leg_table(records, [
            report.Column("makespan s", "makespan_s"),
            report.Column("failures", "failures", digits=0),
        ])

A module may also define ``headline(records)``, returning :class:`Versus` rows for the opening
table (dsclient against each peer). Figures are medians over the runs, with their range; a
latency tail is the p99 only where every run had at least 200 samples, else the p95 (at least
20), else the maximum, and the column says which.

Today's code only: the opening table and the home blocks take a benchmark's results that ran on
HEAD's request path (:func:`staleness`), pooled over every such invocation set up alike
(:func:`pool`); a section shows its newest result, marked **Stale** where it is. The home table
names one peer per claim, the hardest measured (:func:`hardest`), and links its raw files; a
median within +-2% is "equal" (:func:`within_equal`).

Each benchmark's section is its own module's ``render``: a benchmark added later brings its
``render``/``headline`` and, for the home table, a :class:`Pick` appended to :data:`HOME_PICKS`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks._results import RESULTS_ROOT, load_records

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
#: The home page carries a few of the headline table's lines (the ``home`` block).
HOME_PAGE = ROOT / "docs" / "index.md"
#: The README carries the same lines (the ``home-readme`` block: its links go into docs/).
README = ROOT / "README.md"
HEADLINE = "headline-table"
HOME = "home"
HOME_README = "home-readme"
BLOCK = re.compile(
    r"(<!-- BEGIN generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
    r"(<!-- END generated: (?P=name) -->)",
    re.DOTALL,
)
#: Samples a percentile needs before it is called that: fewer, and p99 is just the maximum.
P99_MIN = 200
#: The opening table shows a figure only where it stands on at least this many runs.
HEADLINE_MIN_RUNS = 3
P95_MIN = 20
NONE = "-"


# -- numbers -------------------------------------------------------------------------------------
def summary(values: Iterable[float | None]) -> tuple[float, float, float, int] | None:
    """Median, min, max and count of the values that are not ``None`` (``None`` if none are)."""
    found = [float(v) for v in values if v is not None]
    if not found:
        return None
    return statistics.median(found), min(found), max(found), len(found)


def fmt(value: float, digits: int) -> str:
    return f"{value:.{digits}f}"


def spread_cell(values: Iterable[float | None], digits: int = 2, suffix: str = "") -> str:
    """``median (min-max)``, or one value alone; ``-`` when there is none."""
    found = summary(values)
    if found is None:
        return NONE
    mid, low, high, n = found
    if n == 1 or low == high:
        return fmt(mid, digits) + suffix
    return f"{fmt(mid, digits)}{suffix} ({fmt(low, digits)}-{fmt(high, digits)})"


def tail_name(counts: Iterable[int | None]) -> str:
    """Which tail every run can support: ``p99`` (>= 200 samples), ``p95`` (>= 20), ``max``."""
    found = [c for c in counts if c is not None]
    least = min(found, default=0)
    if least >= P99_MIN:
        return "p99"
    if least >= P95_MIN:
        return "p95"
    return "max"


# -- rows ----------------------------------------------------------------------------------------
def latest(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The newest invocation (the one a table shows); earlier ones are listed by file name."""
    return records[-1] if records else None


def legs(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Leg names in first-seen order."""
    seen: dict[str, None] = {}
    for row in rows:
        seen.setdefault(str(row["leg"]), None)
    return list(seen)


def select(rows: Iterable[Mapping[str, Any]], **match: Any) -> list[Mapping[str, Any]]:
    """The rows whose fields equal every ``match`` (``leg="dsclient", workload="batch"``)."""
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


@dataclass(frozen=True)
class Column:
    """One column of a per-leg table: a figure's median (range) over the runs.

    ``key`` names the row field; a ``key`` with ``{tail}`` in it (``"short_{tail}_s"``) is a
    latency tail, chosen per table from ``count`` (``"short_n"``) by :func:`tail_name`, and the
    heading's ``{tail}`` is filled in likewise.
    """

    heading: str
    key: str
    digits: int = 2
    count: str | None = None
    suffix: str = ""


def resolve(column: Column, rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The heading and row key of ``column`` for these rows (the tail filled in)."""
    if "{tail}" not in column.key:
        return column.heading, column.key
    tail = tail_name(r.get(column.count or "") for r in rows)
    return column.heading.format(tail=tail), column.key.format(tail=tail)


def leg_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[Column],
    *,
    about: Mapping[str, str] | None = None,
) -> str:
    """One line per leg: its runs, then each column's median (min-max) over them.

    A tail column's heading names the tail most legs support; a leg whose runs support less
    (fewer answers: failures) says its own in the cell (``max: 6.25``).
    """
    if not rows:
        return "No rows."
    names = legs(rows)
    per_leg = {name: select(rows, leg=name) for name in names}
    heads, keys = [], []
    for column in columns:
        own = {name: resolve(column, mine) for name, mine in per_leg.items()}
        tails = [key for _, key in own.values()]
        common = max(tails, key=tails.count)
        heads.append(next(h for h, k in own.values() if k == common))
        keys.append({name: key for name, (_, key) in own.items()} | {"": common})
    head = ["leg", "runs", *heads]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        mine = per_leg[name]
        runs = len({r.get("run") for r in mine})
        cells = []
        for column, key in zip(columns, keys, strict=True):
            cell = spread_cell((r.get(key[name]) for r in mine), column.digits, column.suffix)
            if key[name] != key[""] and cell != NONE:
                cell = f"{key[name].split('_')[1]}: {cell}"
            cells.append(cell)
        label = f"{name}: {about[name]}" if about and name in about else name
        lines.append("| " + " | ".join([label, str(runs), *cells]) + " |")
    return "\n".join(lines)


#: The opening table's columns: what each :class:`Versus` is filed under.
HEADLINE_COLUMNS = ("makespan", "short-request tail", "long-request tail", "other")


@dataclass(frozen=True)
class Versus:
    """A cell of the opening table: dsclient's figure over a peer's, per run.

    ``column`` is one of :data:`HEADLINE_COLUMNS`; ``label`` says which figure it is when the
    column does not (``"p95"``, ``"prefix hit rate"``). ``workload`` splits a benchmark's rows
    (``"batch"``, ``"online"``).
    """

    benchmark: str
    peer: str
    column: str
    ratios: tuple[float, ...]
    label: str = ""
    workload: str = ""
    text: str = ""  # shown instead of the ratios (counts, where a ratio would mislead)
    higher_better: bool = False
    files: tuple[str, ...] = ()  # the raw files behind it (set by headline_lines)

    def __post_init__(self) -> None:
        if self.column not in HEADLINE_COLUMNS:
            raise ValueError(f"column must be one of {HEADLINE_COLUMNS}, got {self.column!r}")


def ratios(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    peer: str,
    *,
    ours: str = "dsclient",
    **match: Any,
) -> tuple[float, ...]:
    """``ours / peer`` of ``key`` for each run where both have a figure (and peer's is not 0)."""
    found = []
    mine = {r.get("run"): r.get(key) for r in select(rows, leg=ours, **match)}
    for row in select(rows, leg=peer, **match):
        a, b = mine.get(row.get("run")), row.get(key)
        if a is not None and b:
            found.append(round(float(a) / float(b), 3))
    return tuple(found)


def failures(
    rows: Sequence[Mapping[str, Any]],
    key: str,
    peer: str,
    benchmark: str,
    *,
    ours: str = "dsclient",
    workload: str = "",
    **match: Any,
) -> list[Versus]:
    """An "other" cell with the failed calls of each side (median over runs), when any failed.

    A peer that fails calls finishes sooner; its makespan ratio alone would flatter it.
    """
    if workload:
        match["workload"] = workload
    mine = summary(r.get(key) for r in select(rows, leg=ours, **match))
    theirs = summary(r.get(key) for r in select(rows, leg=peer, **match))
    if mine is None or theirs is None or (mine[2] == 0 and theirs[2] == 0):
        return []
    text = f"failed, median {mine[0]:g} vs {theirs[0]:g} (max {mine[2]:g} vs {theirs[2]:g})"
    return [Versus(benchmark, peer, "other", (), text=text, workload=workload)]


def headline_table(lines: Sequence[Versus]) -> str:
    """The page's opening table: one line per benchmark (and workload) and peer.

    Each cell is dsclient's figure over the peer's in the same run, the median over runs with
    the range; below 1 means dsclient's was smaller (shorter, fewer), except where the label
    says higher is better. ``runs`` is the fewest runs behind any cell of the line.
    """
    if not lines:
        return "No results on today's request path yet."
    keys: dict[tuple[str, str, str], dict[str, list[Versus]]] = {}
    for v in lines:
        keys.setdefault((v.benchmark, v.workload, v.peer), {}).setdefault(v.column, []).append(v)
    head = ["benchmark", "peer", *(f"{c} (dsclient / peer)" for c in HEADLINE_COLUMNS), "runs"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (benchmark, workload, peer), cells in keys.items():
        shown = []
        for column in HEADLINE_COLUMNS:
            parts = []
            for v in cells.get(column, []):
                cell = v.text or spread_cell(v.ratios, 2, "\N{MULTIPLICATION SIGN}")
                parts.append(f"{v.label}: {cell}" if v.label else cell)
            shown.append("; ".join(parts) or NONE)
        every = [v for vs in cells.values() for v in vs if v.ratios]
        runs = min((len(v.ratios) for v in every), default=0)
        name = f"{benchmark} ({workload})" if workload else benchmark
        out.append("| " + " | ".join([name, peer, *shown, str(runs)]) + " |")
    return "\n".join(out)


# -- today's code only ---------------------------------------------------------------------------
#: What a figure of dsclient depends on: its request path, every module but the command line and
#: the launcher (which start the server the same way for every leg). A result that ran on other
#: code here than HEAD's is stale: still on the page (marked), never on the home table.
REQUEST_PATH = ("dsclient", ":(exclude)dsclient/cli", ":(exclude)dsclient/launcher")
#: The git checkout whose HEAD the results are judged against (tests point it elsewhere).
REPO = ROOT


def on_request_path(path: str) -> bool:
    """Whether a changed file (as ``git status`` names it) is on :data:`REQUEST_PATH`."""
    path = path.split(" -> ")[-1].strip('"')
    return path.startswith("dsclient/") and not path.startswith(
        ("dsclient/cli/", "dsclient/launcher/")
    )


@functools.lru_cache(maxsize=256)
def _changed_since(commit: str, repo: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "diff", "--quiet", commit, "HEAD", "--", *REQUEST_PATH],
            cwd=repo, capture_output=True, check=False, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "git could not compare its commit with HEAD"
    if done.returncode == 0:
        return None
    if done.returncode == 1:
        return f"dsclient's request path changed between its commit `{commit[:10]}` and HEAD"
    return f"its commit `{commit[:10]}` is not in this checkout"


def staleness(record: Mapping[str, Any]) -> str | None:
    """Why ``record`` did not run on HEAD's request path, or ``None`` when it did.

    Stale: an aborted run (kept with its reason); no commit recorded; a tree whose request-path
    files differed from its commit (what ran is known nowhere); a commit whose request path
    differs from HEAD's (``git diff``).
    """
    aborted = (record.get("facts") or {}).get("aborted")
    if aborted:
        return f"the run was aborted ({aborted})"
    code = record.get("code") or {}
    commit = code.get("commit")
    if not commit:
        return "no commit recorded"
    dirty = [p for p in code.get("changed") or [] if on_request_path(p)]
    if code.get("dirty") and dirty:
        shown = ", ".join(f"`{p}`" for p in dirty[:3]) + (", ..." if len(dirty) > 3 else "")
        return f"it ran on uncommitted changes to the request path ({shown})"
    return _changed_since(str(commit), REPO)


def current(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The records that ran on HEAD's request path, oldest first."""
    return [r for r in records if staleness(r) is None]


#: Parameters that do not change what one run measures: invocations differing only in these
#: are pooled (one with ``--quick`` or another batch size is not).
POOLED_PARAMS = frozenset(
    {"runs", "seed", "wait_for_others", "no_save", "pause", "url", "servers", "clients",
     "workloads", "shared_cpus"}
)  # fmt: skip


def _same_setup(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    pa, pb = a.get("params") or {}, b.get("params") or {}
    keys = (set(pa) | set(pb)) - POOLED_PARAMS
    return all(pa.get(k) == pb.get(k) for k in keys)


def pool(records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One record of the rows of every invocation set up like the newest (same parameters
    but the run count, seed and which legs): each row's ``run`` becomes ``"FILE#RUN"`` so that
    ratios still pair runs of one invocation. Its ``_files`` lists the files pooled; the rest
    (conditions, facts, notes) is the newest's. ``None`` for no records."""
    if not records:
        return None
    newest = records[-1]
    used = [r for r in records if _same_setup(r, newest)]
    rows = [
        {**row, "run": f"{r.get('_file')}#{row.get('run')}"} for r in used for row in r["rows"]
    ]
    return {**newest, "rows": rows, "_files": [r.get("_file") for r in used]}


def within_equal(ratio: float) -> bool:
    """A median ratio within +-:data:`EQUAL` of 1 is "equal", neither better nor worse."""
    return abs(ratio - 1.0) <= EQUAL


#: Medians this close to 1 (2 %) are ties: a run-to-run spread on this machine is larger.
EQUAL = 0.02


# -- the home page -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pick:
    """One line of the home page: a headline figure against one peer.

    ``what`` names the figure for a newcomer; ``anchor`` is the benchmarks page's section."""

    what: str
    benchmark: str
    workload: str
    peer: str | tuple[str, ...]  # several: the hardest of them on ``hardest_on`` (by median)
    column: str
    anchor: str
    peer_text: str
    hardest_on: str = "makespan"


#: The results a newcomer deciding on dsclient needs, good and bad, each against the hardest peer
#: measured on that workload (one peer per claim: its gain and its cost against the same one);
#: each links to its section of the benchmarks page and to its raw files.
SEMAPHORES = tuple(f"openai+priority+sem{n}" for n in (5, 8, 16))
ROUTERS = ("router-rr", "router-cache", "router-p2", "router-cache+priority")
HOME_PICKS: tuple[Pick, ...] = (
    Pick(
        "Short requests' p95 latency during a burst of long ones",
        "headline", "online", "openai+priority", "short-request tail",
        "headline-benchmark-one-vllm-batch-and-online",
        "openai-python sending vLLM's `priority` (the server schedules by it)",
    ),
    Pick(
        "What the long requests pay for it: their p95 latency",
        "headline", "online", "openai+priority", "long-request tail",
        "headline-benchmark-one-vllm-batch-and-online",
        "openai-python sending vLLM's `priority` (the server schedules by it)",
    ),
    Pick(
        "Short requests' time to first token (p95), lengths spread lognormally, streamed",
        "headline", "serving", "openai+priority", "short-request tail",
        "headline-benchmark-one-vllm-batch-and-online",
        "openai-python sending vLLM's `priority` (the server schedules by it)",
    ),
    Pick(
        "Goodput (calls meeting TTFT and TPOT objectives per second), same workload",
        "headline", "serving", "openai+priority", "other",
        "headline-benchmark-one-vllm-batch-and-online",
        "openai-python sending vLLM's `priority` (the server schedules by it)",
    ),
    Pick(
        "A batch of short requests, makespan",
        "headline", "batch", SEMAPHORES, "makespan",
        "headline-benchmark-one-vllm-batch-and-online",
        "openai-python behind the best fixed semaphore of 0.7x, 1x, 2x `max_num_seqs`",
    ),
    Pick(
        "A batch through a gateway that hides `/metrics`, makespan",
        "blackbox", "nginx-vllm, batch", ("semaphore 8", "semaphore 32", "semaphore 128"),
        "makespan",
        "servers-that-publish-nothing-vllm-behind-nginx-transformers-serve-vllms-priority",
        "httpx behind the best fixed semaphore of 8, 32, 128",
    ),
    Pick(
        "Two replicas, one slowed: short requests' p95 latency",
        "routing", "", ROUTERS, "short-request tail",
        "routing-two-replicas-one-slowed",
        "vllm-router (with or without `priority`), the leg with the best makespan",
    ),
    Pick(
        "Two replicas, one slowed: makespan",
        "routing", "", ROUTERS, "makespan",
        "routing-two-replicas-one-slowed",
        "vllm-router (with or without `priority`), the leg with the best makespan",
    ),
    Pick(
        "Four processes on one server, makespan",
        "shared (four-shared)", "", ("four-static", "four-static-2x"), "makespan",
        "shared-budget-four-processes-one-server",
        "four processes with a static split at 1x or 2x `max_num_seqs / 4`, the faster",
    ),
    Pick(
        "A Ray Data job, makespan",
        "ray", "", ("ray-http-qps40", "ray-http-actors8", "ray-gather16"), "makespan",
        "ray-data-dsclientray-against-raydatallm",
        "ray.data.llm's HTTP processor or `map_batches` with an async gather, the fastest",
    ),
)  # fmt: skip


def _enough(v: Versus) -> bool:
    return len(v.ratios) >= HEADLINE_MIN_RUNS


def hardest(lines: Sequence[Versus], pick: Pick) -> str | None:
    """The peer of ``pick`` that dsclient does worst against on ``pick.hardest_on`` (median
    over at least :data:`HEADLINE_MIN_RUNS` runs), or ``None`` when none has that many; a
    pick naming one peer gets that one."""
    if isinstance(pick.peer, str):
        return pick.peer
    peers = pick.peer
    scored = []
    for v in lines:
        where = (v.benchmark, v.workload, v.column)
        if where == (pick.benchmark, pick.workload, pick.hardest_on) and v.peer in peers:
            found = summary(v.ratios) if _enough(v) else None
            if found is not None:
                scored.append((found[0] if not v.higher_better else -found[0], v.peer))
    return max(scored)[1] if scored else None


def ratio_cell(ratios: Sequence[float]) -> str:
    """The median (range) of ``ratios``, with "equal" where the median is within +-2 %."""
    cell = spread_cell(ratios, 2, "\N{MULTIPLICATION SIGN}")
    found = summary(ratios)
    if found is not None and within_equal(found[0]):
        cell += " (equal)"
    return cell


#: What the home table's figures can say, linked from above it.
HOME_CAVEAT = (
    "Measured on a shared 2-core x86-64 VM without a GPU, on vLLM's CPU build serving a tiny "
    "random model, the client on one core and the server on the other; only results that ran on "
    "today's request path are here, pooled over every such invocation "
    "([what this can and cannot show]({docs}benchmarks.md#what-these-figures-can-and-cannot-show))."
)


def raw_file(path: str, root: str, text: str) -> str:
    """A raw result file named on a page: a link from the README (``root`` ``""``: the
    repository shows it), its path in code on a docs page (``root`` ``"../"``): the site has no
    address for files outside ``docs/``, and mkdocs' strict build refuses such a link."""
    if root == "":
        return f"[{text}]({path})"
    return f"{text}: `{path}`"


def home_block(lines: Sequence[Versus], docs: str = "", root: str = "../") -> str:
    """The home page's table: each pick against its (hardest) peer, median ratio and range
    over the runs, linked to its section and its raw files.

    A pick without results of at least :data:`HEADLINE_MIN_RUNS` runs is left out; below 1x
    means dsclient's figure was smaller. ``docs`` is the path from the page to the docs folder
    (``"docs/"`` from the README), ``root`` to the repository's root (``""`` from it)."""
    out = ["| result | dsclient / peer | peer | runs | raw |", "|---|---|---|---|---|"]
    for pick in HOME_PICKS:
        peer = hardest(lines, pick)
        found = [
            v
            for v in lines
            if (v.benchmark, v.workload, v.peer, v.column)
            == (pick.benchmark, pick.workload, peer, pick.column)
            and _enough(v)
        ]
        if not found:
            continue
        v = found[0]
        what = f"[{pick.what}]({docs}benchmarks.md#{pick.anchor})"
        named = pick.peer_text if isinstance(pick.peer, str) else f"{pick.peer_text}: `{peer}`"
        raw = " ".join(raw_file(path, root, str(n)) for n, path in enumerate(v.files, 1)) or NONE
        cell = ratio_cell(v.ratios) + (", higher is better" if v.higher_better else "")
        out.append(f"| {what} | {cell} | {named} | {len(v.ratios)} | {raw} |")
    if len(out) == 2:
        return (
            "No results on today's request path yet: the [benchmarks page]"
            f"({docs}benchmarks.md) shows the older ones, marked stale."
        )
    return HOME_CAVEAT.format(docs=docs) + "\n\n" + "\n".join(out)


# -- conditions ----------------------------------------------------------------------------------
def loads(record: Mapping[str, Any]) -> list[float]:
    """The 1-minute load averages recorded: before, at each row, after."""
    found = [*record.get("load_before", [])[:1], *record.get("load_after", [])[:1]]
    found += [r["load_1min"] for r in record.get("rows", []) if r.get("load_1min") is not None]
    return [float(x) for x in found]


#: Other work's median CPU (cores) over the legs at which a run's machine counts as busy, where
#: the rows measured it (``others_cores``: the machine's CPU less the client's and the server's).
BUSY_OTHERS = 0.5


def busy(record: Mapping[str, Any]) -> str | None:
    """Why the machine counts as busy during ``record``'s legs, or ``None``: where the rows
    measured other work's CPU (``others_cores``), its median over them is at least
    :data:`BUSY_OTHERS` cores; else the median 1-minute load is above the cores (a load that
    counts the benchmark's own client and server too)."""
    rows = record.get("rows", [])
    cores = record.get("host", {}).get("cores") or 1
    others = summary([r.get("others_cores") for r in rows])
    if others is not None:
        if others[0] < BUSY_OTHERS:
            return None
        return (
            f"other work (not the clients or the server) took a median of {others[0]:.2f} of "
            f"the {cores} cores during the legs"
        )
    found = summary([r.get("load_1min") for r in rows])
    if found is None or found[0] <= cores:
        return None
    return "the median load over the legs was above the core count, so other work shared the CPUs"


def placement_line(record: Mapping[str, Any]) -> str:
    """Where the client and the server's processes ran (``placement`` facts, one per server),
    as found by :func:`benchmarks._common.placement_facts`; a run that did not record it may
    have had the client on the server's CPUs, and the line says so."""
    facts = record.get("facts", {})
    found = {k.removeprefix("placement").strip(): v for k, v in facts.items()
             if k.startswith("placement") and isinstance(v, Mapping)}  # fmt: skip
    if not found:
        planned = [v for k, v in facts.items() if k.startswith("placement") and isinstance(v, str)]
        if planned:  # older files: the plan, not where the threads were found
            return f"Placement planned, not checked: {'; '.join(planned)}."
        return (
            "**Placement not recorded:** the client may have shared the server's CPUs, taking "
            "CPU the server would have had on two hosts."
        )
    parts = []
    for server, place in found.items():
        where = (
            f"client on CPU {place.get('client_cpus')}, server's processes on CPU "
            f"{place.get('server_cpus')}"
            if place.get("server_cpus")
            else f"client on CPU {place.get('client_cpus')}, server's processes not found here"
        )
        if not place.get("apart"):
            where = f"**not apart**: {where}"
        parts.append(f"{server}: {where}" if server else where)
    return "Placement: " + "; ".join(parts) + "."


def conditions(record: Mapping[str, Any], records: Sequence[Mapping[str, Any]] = ()) -> str:
    """Where the table's figures come from: file, commit, versions, machine, load."""
    code = record.get("code", {})
    commit = (code.get("commit") or "unknown")[:10]
    dirty = code.get("dirty")
    changed = code.get("changed") or []
    tree = "clean tree" if dirty is False else "tree differed from the commit" if dirty else "?"
    if dirty and changed:
        shown = ", ".join(f"`{p}`" for p in changed[:6])
        tree += f" ({shown}{', ...' if len(changed) > 6 else ''})"
    host = record.get("host", {})
    versions = ", ".join(
        f"{name} {ver or 'absent'}" for name, ver in sorted(record.get("versions", {}).items())
    )
    found = loads(record)
    load = (
        f"1-minute load {min(found):.2f}-{max(found):.2f} on {host.get('cores')} cores"
        if found
        else "load not recorded"
    )
    lines = [
        f"From `benchmarks/results/{record.get('benchmark')}/{record.get('_file')}`: "
        f"started {record.get('started_utc')}, commit `{commit}`, {tree}; "
        f"Python {host.get('python')}, {host.get('cpu', host.get('machine'))}; {versions}; "
        f"{load}.",
    ]
    lines.append(placement_line(record))
    stale = staleness(record)
    if stale:
        lines.append(f"**Stale:** {stale}; these figures are not on the home table.")
    why = busy(record)
    if why:
        lines.append(f"**Busy machine:** {why}; read these figures as this machine on that day.")
    earlier = [r.get("_file") for r in records if r is not record]
    if earlier:
        lines.append("Earlier invocations kept: " + ", ".join(f"`{e}`" for e in earlier) + ".")
    for note in record.get("notes", []):
        lines.append(f"Note: {note}")
    return "\n\n".join(lines)


# -- the page ------------------------------------------------------------------------------------
Renderer = Callable[[Sequence[Mapping[str, Any]]], str]


def module_for(name: str) -> Any:
    from benchmarks.__main__ import BENCHMARKS

    if name not in BENCHMARKS:
        raise KeyError(f"no benchmark named {name!r} (benchmarks/__main__.py)")
    return importlib.import_module(BENCHMARKS[name][0])


def verdict(lines: Sequence[Versus]) -> str:
    """Per figure, the peers against which dsclient's median was worse, better, and equal
    (within +-:data:`EQUAL`: a tie is not a win), as a list."""
    groups: dict[tuple[str, str], tuple[list[str], list[str], list[float], list[float]]] = {}
    equal: dict[tuple[str, str], list[str]] = {}
    for v in lines:
        found = summary(v.ratios)
        if found is None:
            continue
        name = f"{v.benchmark} ({v.workload})" if v.workload else v.benchmark
        what = f"{v.label} {v.column}" if v.label and v.column != "other" else v.label or v.column
        worse, better, worse_x, better_x = groups.setdefault((name, what), ([], [], [], []))
        mid = found[0]
        if within_equal(mid):
            equal.setdefault((name, what), []).append(v.peer)
            continue
        if (mid > 1) == v.higher_better:
            better.append(v.peer)
            better_x.append(mid)
        else:
            worse.append(v.peer)
            worse_x.append(mid)

    def span(values: list[float]) -> str:
        x = "\N{MULTIPLICATION SIGN}"
        low, high = min(values), max(values)
        return f"{low:.2f}{x}" if low == high else f"{low:.2f}-{high:.2f}{x}"

    out = []
    for (name, what), (worse, better, worse_x, better_x) in groups.items():
        ties = equal.get((name, what), [])
        n = len(worse) + len(better) + len(ties)
        parts = []
        if worse:
            parts.append(f"worse against {', '.join(worse)} ({len(worse)} of {n}; medians "
                         f"{span(worse_x)})")  # fmt: skip
        if better:
            parts.append(f"better against {len(better)} of {n} (medians {span(better_x)})")
        if ties:
            parts.append(f"equal (within {EQUAL:.0%}) against {', '.join(ties)} "
                         f"({len(ties)} of {n})")  # fmt: skip
        if parts:
            out.append(f"- {name}, {what}: dsclient " + "; ".join(parts) + ".")
    return "\n".join(out)


def provenance(names: Sequence[str], root: Path) -> str:
    """One line per benchmark: the files pooled into its cells, each with its commit, the
    load, busy or not."""
    out = []
    for name in names:
        records = current(load_records(name, root))
        pooled = pool(records)
        if pooled is None:
            continue
        parts = []
        for record in (r for r in records if r.get("_file") in pooled["_files"]):
            found = loads(record)
            load = f"load {min(found):.2f}-{max(found):.2f}" if found else "load not recorded"
            commit = (record.get("code", {}).get("commit") or "unknown")[:10]
            parts.append(
                f"`benchmarks/results/{name}/{record.get('_file')}` "
                f"(commit `{commit}`, {load}" + (", busy machine" if busy(record) else "") + ")"
            )
        cores = pooled.get("host", {}).get("cores")
        out.append(f"- {name} ({cores} cores): " + "; ".join(parts) + ".")
    if not out:
        return ""
    return "Sources, every invocation on today's request path:\n\n" + "\n".join(out)


def render_block(name: str, root: Path) -> str:
    """The markdown of one generated block: the headline table, or a benchmark's section."""
    if name == HEADLINE:
        every = headline_lines(root)
        lines = [v for v in every if len(v.ratios) >= HEADLINE_MIN_RUNS or v.text]
        fewer = sorted(
            {v.benchmark.split(" ")[0] for v in every if v.ratios}
            - {v.benchmark.split(" ")[0] for v in lines if v.ratios}
        )
        said = verdict(lines)
        if said:
            said = "Where dsclient's median was worse, and better, by figure:\n\n" + said
        sources = provenance(sorted({v.benchmark.split(" ")[0] for v in lines}), root)
        stale = stale_benchmarks(root)
        if stale:
            sources += "\n\n" if sources else ""
            sources += (
                "Not in this table, as none of their results ran on today's request path "
                "(their sections show the newest, marked stale): "
                + ", ".join(f"`{b}`" for b in stale) + "."
            )
        short = (
            f"Benchmarks with fewer than {HEADLINE_MIN_RUNS} runs of each leg are not in this "
            "table; their sections show them: " + ", ".join(f"`{b}`" for b in fewer) + "."
            if fewer
            else ""
        )
        parts = (headline_table(lines), short, said, sources)
        return "\n\n".join(part for part in parts if part)
    if name in (HOME, HOME_README):
        readme = name == HOME_README
        return home_block(headline_lines(root), "docs/" if readme else "", "" if readme else "../")
    records = load_records(name, root)
    if not records:
        return "No results committed yet: run `python -m benchmarks " + name + "`."
    render: Renderer = module_for(name).render
    return render(records)


def headline_lines(root: Path) -> list[Versus]:
    """Every benchmark's :class:`Versus` lines, from its results on today's request path only,
    pooled over those invocations (:func:`pool`); each line names the files behind it."""
    from benchmarks.__main__ import BENCHMARKS

    lines: list[Versus] = []
    for name in BENCHMARKS:
        make = getattr(module_for(name), "headline", None)
        pooled = pool(current(load_records(name, root)))
        if make is None or pooled is None:
            continue
        files = tuple(f"benchmarks/results/{name}/{f}" for f in pooled["_files"])
        lines.extend(replace(v, files=files) for v in make([pooled]))
    return lines


def stale_benchmarks(root: Path) -> list[str]:
    """The benchmarks with an opening-table line whose results all predate today's request
    path."""
    from benchmarks.__main__ import BENCHMARKS

    return [
        name
        for name in BENCHMARKS
        if getattr(module_for(name), "headline", None) is not None
        and (records := load_records(name, root))
        and not current(records)
    ]


def render_page(text: str, root: Path = RESULTS_ROOT) -> str:
    """``text`` with every generated block rewritten from the results under ``root``."""

    def fill(match: re.Match[str]) -> str:
        body = render_block(match["name"], root).rstrip("\n") + "\n"
        return f"{match[1]}{body}{match[4]}"

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    parser.add_argument(
        "--page", type=Path, action="append",
        help="a page to rewrite (default: docs/benchmarks.md, docs/index.md, README.md)",
    )  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS_ROOT, help="the results folder")
    args = parser.parse_args(argv)
    stale = 0
    for page in args.page or [PAGE, HOME_PAGE, README]:
        text = page.read_text()
        fresh = render_page(text, args.results)
        if args.check:
            if fresh != text:
                print(f"{page} is not what the results give: run python -m benchmarks report")
                stale = 1
        elif fresh != text:
            page.write_text(fresh)
            print(f"rewrote the generated blocks of {page}")
        else:
            print(f"{page} is up to date")
    return stale


if __name__ == "__main__":
    sys.exit(main())
