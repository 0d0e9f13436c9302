"""The batch runner behind ``client.map()`` and ``client.imap()``.

    results = await client.map(prompts, max_tokens=32, output="results.jsonl", resume=True)
    print(results.failures, results.summary())

A pool of workers pulls items one at a time and calls the client; the client's governor orders
the calls. There are ``limit + read_ahead(limit)`` workers, so a few calls always wait in the
governor: that waiting is the demand the limit controller grows on. The pool follows the limit:
when it rises, workers are added (never removed; extra ones just wait for a slot).

Which item a free worker takes is the order's (``order=``): by default a window of the next
``WINDOW`` (1024) items read is kept, and a :class:`~dsclient.batch._order.Lineup` hands out
items that share a prefix together and the longest first (:mod:`dsclient.batch._order`);
``order="input"`` reads the input one item per worker, in order. Items are numbered, named and
matched against the output file as they are read, in input order, so an item's index and id
(and so resume) do not depend on the order they start in.

For ``map()`` each worker records its own outcomes, so the input is read at most
``L + read_ahead(L)`` items ahead of what is done, ``L`` the highest limit of the run (plus the
window). For ``imap()`` a finished outcome waits in its worker or in a buffer of read-ahead size
until the consumer takes it, so the input is read at most ``L + 2 * read_ahead(L)`` items (plus
the window) ahead of what has been yielded, whatever its length: with ``output=`` a batch of a
million items runs in flat memory.

Items are prompts (``str``), message lists, or request dicts::

    {"prompt": "Once upon a time", "id": "story-1", "max_tokens": 64, "temperature": 0.7}
    {"messages": [{"role": "user", "content": "Hi"}], "custom_id": "chat-1"}

where ``id``/``custom_id`` names the item (for ``output=`` and resume), ``max_tokens`` and
every other key override the call's own for that item. Resume matching and id rules are in
:mod:`dsclient.batch._jsonl`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypeVar, cast

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._arguments import (
    USE_DEFAULT,
    UseDefault,
    check_max_tokens,
    check_messages,
    check_prompt,
)
from .._models import Failure, Result
from .._percentile import nearest_rank
from ._caller import BatchCaller, BatchClient, BatchPlanner
from ._jsonl import JsonlStore, derive_id, explicit_id
from ._order import ORDERS, WINDOW, ItemShape, Lineup, Order, predicted_tokens, prefix_of
from ._progress import Progress, open_progress

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from anyio.from_thread import BlockingPortal

__all__ = ["BatchResults", "InvalidItem", "iter_map", "iter_map_blocking", "run_map"]

OnError = Literal["return", "raise"]
Outcome: TypeAlias = Result | Failure
T = TypeVar("T")
_ON_ERROR = ("return", "raise")
_RESERVED = frozenset({"id", "custom_id", "prompt", "messages", "max_tokens"})


#: Long-lane items the shaped order may have handed out beyond those running: enough that a
#: long slot that frees is taken at once, few enough that the other workers run short items.
LONG_READY = 2


def read_ahead(limit: int) -> int:
    """Workers beyond the cap, so the next calls are ready when slots free: ``max(2, limit/4)``."""
    return max(2, limit // 4)


class InvalidItem:
    """An input item already known to be bad (the command line's unparsable lines).

    map() turns it into a :class:`Failure` carrying ``error``, under ``id``.
    """

    __slots__ = ("error", "id")

    def __init__(self, error: Exception, id: str | None = None) -> None:
        self.error: Exception = error
        self.id: str | None = id


class BatchResults(list[Outcome]):
    """What ``map()`` returns: a list of results and :class:`Failure` s, plus a summary.

        results = client.map(prompts, max_tokens=16)
        results.failures        # the Failure entries
        results.summary()       # count, ok, failed, resumed, throughput, p50/p99 latency

    In a notebook it shows as a small table instead of a wall of reprs.
    """

    def __init__(
        self, outcomes: Iterable[Outcome] = (), *, elapsed_s: float = 0.0, resumed: int = 0
    ) -> None:
        super().__init__(outcomes)
        self.elapsed_s = elapsed_s
        self.resumed = resumed

    @property
    def failures(self) -> list[Failure]:
        return [o for o in self if isinstance(o, Failure)]

    @property
    def ok(self) -> list[Result]:
        """The results that succeeded, in this list's order."""
        return [o for o in self if isinstance(o, Result)]

    def summary(self) -> dict[str, Any]:
        """Counts, throughput (items/s over the run) and nearest-rank latency percentiles."""
        latencies = sorted(o.latency_s for o in self if isinstance(o, Result))
        failed = sum(1 for o in self if isinstance(o, Failure))
        return {
            "count": len(self),
            "ok": len(self) - failed,
            "failed": failed,
            "resumed": self.resumed,
            "elapsed_s": self.elapsed_s,
            "items_per_s": (len(self) - self.resumed) / self.elapsed_s if self.elapsed_s else None,
            "p50_latency_s": nearest_rank(latencies, 50) if latencies else None,
            "p99_latency_s": nearest_rank(latencies, 99) if latencies else None,
        }

    def __repr__(self) -> str:
        s = self.summary()
        rate = f", {s['items_per_s']:.1f} items/s" if s["items_per_s"] is not None else ""
        p50 = f", p50 {s['p50_latency_s']:.3f} s" if s["p50_latency_s"] is not None else ""
        p99 = f", p99 {s['p99_latency_s']:.3f} s" if s["p99_latency_s"] is not None else ""
        resumed = f" ({s['resumed']} resumed)" if s["resumed"] else ""
        return (
            f"BatchResults({s['count']} items: {s['ok']} ok, {s['failed']} failed{resumed}"
            f"{rate}{p50}{p99})"
        )

    def _repr_html_(self) -> str:
        from .._display import batch_html

        return batch_html(self.summary(), self.failures)


# -- reading the input -------------------------------------------------------------------------
class _Source:
    """Numbers the items of an iterable or async iterable as they are read, one at a time."""

    @property
    def exhausted(self) -> bool:
        return self._exhausted

    def __init__(self, items: Any) -> None:
        if isinstance(items, (str, bytes, Mapping)):
            raise TypeError(
                f"items must be an iterable of prompts, message lists or request dicts, got a "
                f"single {type(items).__name__}; wrap it in a list"
            )
        self._iter: Iterator[Any] | None = None
        self._aiter: AsyncIterator[Any] | None = None
        if isinstance(items, AsyncIterable):
            self._aiter = aiter(items)
            self._lock = anyio.Lock()  # an async generator cannot be advanced concurrently
        elif isinstance(items, Iterable):
            self._iter = iter(items)
        else:
            raise TypeError(
                f"items must be an iterable or async iterable, got {type(items).__name__}"
            )
        self._count = 0
        self._exhausted = False

    @property
    def is_async(self) -> bool:
        return self._aiter is not None

    def next_nowait(self) -> tuple[int, Any] | None:
        """The next item of a plain iterable (no await, so workers cannot interleave here)."""
        assert self._iter is not None
        if self._exhausted:
            return None
        try:
            item = next(self._iter)
        except StopIteration:
            self._exhausted = True
            return None
        index, self._count = self._count, self._count + 1
        return index, item

    async def next(self) -> tuple[int, Any] | None:
        """The next item; workers may call it concurrently (input order)."""
        if self._iter is not None:
            return self.next_nowait()
        async with self._lock:
            return await self.next_alone()

    async def next_alone(self) -> tuple[int, Any] | None:
        """The next item of an async iterable, for a caller that is the only one reading it
        (shape order's reader task): no lock, whose checkpoint cost a loop pass an item."""
        assert self._aiter is not None
        if self._exhausted:
            return None
        try:
            item = await anext(self._aiter)
        except StopAsyncIteration:
            self._exhausted = True
            return None
        index, self._count = self._count, self._count + 1
        return index, item


def _parse_item(
    item: Any, index: int, max_tokens: int | None, sampling: dict[str, Any]
) -> tuple[Literal["completion", "chat"], Any, int | None, dict[str, Any]]:
    """``(kind, prompt, max_tokens, sampling)`` of one item; errors name the item's index."""
    if isinstance(item, InvalidItem):
        raise item.error
    try:
        if isinstance(item, str):
            check_prompt(item)
            return "completion", item, max_tokens, sampling
        if isinstance(item, Mapping):
            has_prompt, has_messages = "prompt" in item, "messages" in item
            if has_prompt == has_messages:
                raise ValueError(
                    "a request dict needs exactly one of 'prompt' or 'messages', got keys "
                    f"{sorted(map(str, item))}"
                )
            kind: Literal["completion", "chat"] = "completion" if has_prompt else "chat"
            prompt = item["prompt"] if has_prompt else item["messages"]
            (check_prompt if has_prompt else check_messages)(prompt)
            if "max_tokens" in item:
                max_tokens = item["max_tokens"]
                check_max_tokens(max_tokens)
            extra = {k: v for k, v in item.items() if k not in _RESERVED}
            return kind, prompt, max_tokens, ({**sampling, **extra} if extra else sampling)
        if isinstance(item, Sequence) and not isinstance(item, bytes):
            check_messages(item)
            return "chat", item, max_tokens, sampling
        raise TypeError(
            f"expected a prompt str, a message list or a request dict, got {type(item).__name__}"
        )
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"item {index}: {exc}") from None


# -- the run -----------------------------------------------------------------------------------
class _InputFailed:
    """Reading the input raised: the run stops with that error."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


# (index, outcome, item id or None, read back from the output file)
_Done = tuple[int, Outcome, "str | None", bool]


@dataclass(frozen=True)
class _Options:
    """A batch's settings, as map(), imap() and ``dsclient map`` were given them."""

    on_error: OnError
    progress: bool | Mapping[str, Any] | None
    output: str | os.PathLike[str] | JsonlStore | None
    resume: bool
    max_tokens: int | None
    urgency: int
    group: str | None
    timeout: Any
    sampling: dict[str, Any]
    order: Order = "shape"
    window: int = WINDOW  # items read ahead of those started, for order="shape"


class _Prepared:
    """One item read, numbered and looked at: its id, whether the file has its outcome, and
    its request (or why it cannot be one). Done once, in input order, whatever the order the
    items then start in, so resume matches ids exactly as it did before items were reordered."""

    __slots__ = ("cost", "index", "item", "long", "offset", "parsed", "rid")

    def __init__(
        self,
        index: int,
        item: Any,
        rid: str | None,
        offset: int | None,
        parsed: tuple[Literal["completion", "chat"], Any, int | None, dict[str, Any]] | Exception,
    ) -> None:
        self.index = index
        self.item = item
        self.rid = rid
        self.offset = offset  # where the output file holds its outcome, on resume
        self.parsed = parsed
        #: Handed out as a long-lane item by the shaped feed (counted until it is finished).
        self.long = False
        #: Its predicted tokens in the shaped feed (``None``: it costs the server nothing).
        self.cost: int | None = None


class _Feed(Protocol):
    """Where workers take their next item from: input order, or the batch's shape."""

    @property
    def exhausted(self) -> bool:
        """Nothing is left to hand out, nor will be."""
        ...

    def start(self, tg: TaskGroup) -> None:
        """Start what the feed runs beside the workers, in the batch's task group."""
        ...

    async def next(self) -> _Prepared | None:
        """The next item to start; ``None`` at the end; the input's own error if it raised."""
        ...

    def finished(self, prepared: _Prepared) -> None:
        """``prepared``, handed out by :meth:`next`, has its outcome."""
        ...


class _InOrder:
    """Items in input order, read one at a time as workers ask (``order="input"``)."""

    def __init__(self, source: _Source, run: _Run) -> None:
        self._source = source
        self._run = run

    @property
    def exhausted(self) -> bool:
        return self._source.exhausted

    def start(self, tg: TaskGroup) -> None:
        pass

    async def next(self) -> _Prepared | None:
        got = await self._source.next()
        return None if got is None else self._run.prepare(*got)

    def finished(self, prepared: _Prepared) -> None:
        pass


class _Shaped:
    """Items read up to ``window`` ahead of those started and handed out by a :class:`Lineup`
    (``order="shape"``, :mod:`dsclient.batch._order`).

    A plain iterable is topped up in the worker that asks, with no await (as input order reads
    it). An async iterable is read by a task of its own: a worker never waits for the window to
    fill, only for a first item, so a slow or open-ended source starts items as they come.

    Longest first hands out long-lane items only while fewer than :data:`LONG_READY` of those
    it handed out wait for a slot (or are being planned); beyond that a worker takes the next
    short item of the round instead. Otherwise every worker took a long item at the start of a
    round and waited on the long lane, and the server ran the long lane's share and nothing
    beside it: on a vLLM whose KV cache held 4 long items, a mixed batch ran its first waves
    of long items 4 at a time in a batch of 8, and finished 6-17% after input order.
    """

    def __init__(self, source: _Source, run: _Run, window: int = WINDOW) -> None:
        self._source = source
        self._run = run
        self._window = window
        self._lineup: Lineup[_Prepared] = Lineup()
        #: Items in the lineup: ``len(self._lineup)``, counted here (asked several times an
        #: item, the lineup's own count was a tenth of the runner's CPU per item).
        self._held = 0
        self._async = source.is_async
        self._error: Exception | None = None
        self._read_all = False  # the reader task has ended (async sources)
        # Workers waiting for an item, each woken by the item it may take: one wake per item
        # added. One Event for all of them woke every worker at every item, and at 1024 in
        # flight map() spent about 10 ms of CPU an item waking workers that found nothing.
        self._idle: deque[anyio.Event] = deque()
        self._room: anyio.Event | None = None  # set when the reader waits for room
        # The reader wakes when an eighth of the window is free, not at every item started.
        self._low = window - max(1, window // 8)
        self._longs_out = 0  # long items handed out and not finished
        self._is_long = run.planner.is_long
        self._long_in_flight = run.caller.long_in_flight

    @property
    def exhausted(self) -> bool:
        done = self._read_all if self._async else self._source.exhausted
        return done and not self._held

    def start(self, tg: TaskGroup) -> None:
        if self._async:
            tg.start_soon(self._read)

    async def next(self) -> _Prepared | None:
        if not self._async:
            while self._held < self._window and (got := self._source.next_nowait()):
                self._add(*got)
        else:
            while not self._held:
                if self._error is not None:
                    raise self._error
                if self._read_all:
                    return None
                woken = anyio.Event()
                self._idle.append(woken)
                try:
                    await woken.wait()
                except BaseException:
                    if woken.is_set():
                        self._wake_one()  # a wake this worker cannot use goes to the next
                    else:
                        self._idle.remove(woken)
                    raise
        if self._error is not None:
            raise self._error
        if not self._held:
            return None
        ready = self._longs_out - self._long_in_flight()  # waiting for a slot, or planned
        prepared = self._lineup.pop(self._is_long if ready >= LONG_READY else None)
        # Long by the threshold of now, not of when it was read: where the context is not
        # known the threshold comes from the sizes read, and a batch whose first items were
        # long read them under the fallback (1024 tokens). Counted as short, 13 long items
        # were handed out at the start, 10 ran, 3 waited on the long lane, and no short item
        # ran beside them until the first long one ended (3.8 s; the batch took 1.22x).
        cost = prepared.cost
        prepared.long = cost is not None and self._is_long(cost)
        if prepared.long:
            self._longs_out += 1
        self._held -= 1
        if self._room is not None and self._held <= self._low:
            self._room.set()
            self._room = None
        return prepared

    def finished(self, prepared: _Prepared) -> None:
        if prepared.long:
            self._longs_out -= 1

    def _add(self, index: int, item: Any) -> None:
        prepared = self._run.prepare(index, item)
        shape = self._run.shape_of(prepared)
        if not shape.free:
            self._run.planner.read_size(shape.cost)
        prepared.cost = None if shape.free else shape.cost
        self._lineup.add(prepared, shape)
        self._held += 1

    def _wake_one(self) -> None:
        if self._idle:
            self._idle.popleft().set()

    def _wake_all(self) -> None:
        while self._idle:
            self._idle.popleft().set()

    async def _read(self) -> None:
        try:
            while True:
                if self._held >= self._window:
                    room = self._room = anyio.Event()
                    await room.wait()
                got = await self._source.next_alone()
                if got is None:
                    return
                self._add(*got)
                self._wake_one()
        except Exception as exc:
            self._error = exc  # raised in the workers, as input order raises it
        finally:
            self._read_all = True
            self._wake_all()


class _Run:
    """One batch's items: each read, shaped, called (through ``caller``) and settled."""

    def __init__(
        self,
        caller: BatchCaller,
        planner: BatchPlanner,
        store: JsonlStore | None,
        done_ids: dict[str, int],
        options: _Options,
    ) -> None:
        self.caller = caller
        self.planner = planner
        self.store = store
        self.done_ids = done_ids
        self.options = options
        self.running = 0
        #: This batch, to the governor: its own short items do not hold its long ones back,
        #: another batch's do ("Batches" in dsclient.governor._governor).
        self.key = object()

    async def worker(
        self, feed: _Feed, send: MemoryObjectSendStream[_Done | _InputFailed], pool: _Pool
    ) -> None:
        async with send:
            while True:
                message: _Done | _InputFailed
                try:
                    got = await feed.next()
                except Exception as exc:
                    message = _InputFailed(exc)
                else:
                    if got is None:
                        pool.grow()  # the input is done: the pool closes its own sender
                        return
                    message = await self.process(got)
                    feed.finished(got)
                    pool.grow()
                try:
                    try:
                        send.send_nowait(message)  # no checkpoint: the common case is cheap
                    except anyio.WouldBlock:
                        await send.send(message)
                except anyio.BrokenResourceError:
                    return  # the consumer has gone; the task group is being cancelled
                if isinstance(message, _InputFailed):
                    return

    def prepare(self, index: int, item: Any) -> _Prepared:
        """Number, name and parse one item as it is read (in input order)."""
        rid: str | None = None
        offset: int | None = None
        if self.store is not None:
            rid = _id_of(item, index)
            offset = self.done_ids.pop(rid, None)
        parsed: tuple[Literal["completion", "chat"], Any, int | None, dict[str, Any]] | Exception
        try:
            parsed = _parse_item(item, index, self.options.max_tokens, self.options.sampling)
        except (ValueError, TypeError) as exc:
            parsed = exc
        return _Prepared(index, item, rid, offset, parsed)

    def shape_of(self, prepared: _Prepared) -> ItemShape:
        """What the order needs of an item: its prefix and predicted tokens."""
        parsed = prepared.parsed
        if prepared.offset is not None or isinstance(parsed, Exception):
            return ItemShape(free=True)
        _, prompt, max_tokens, _ = parsed
        planner = self.planner
        wanted = max_tokens if max_tokens is not None else planner.default_max_tokens
        return ItemShape(
            blocks=prefix_of(prompt), cost=predicted_tokens(prompt, wanted, planner.tokens)
        )

    async def process(self, prepared: _Prepared) -> _Done:
        index, item, rid = prepared.index, prepared.item, prepared.rid
        if prepared.offset is not None:
            assert self.store is not None
            return index, self.store.load(prepared.offset, index), rid, True
        options = self.options
        parsed = prepared.parsed
        if isinstance(parsed, Exception):
            failure = Failure(index=index, id=rid or _id_of(item, index), error=parsed)
            return index, failure, rid, False
        kind, prompt, max_tokens, sampling = parsed
        self.running += 1
        try:
            result = await self.caller.request(
                kind,
                prompt,
                max_tokens,
                options.urgency,
                options.group,
                options.timeout,
                sampling,
                index=index,
                batch=self.key,
            )
        except Exception as exc:
            # Every item gets an outcome: a bug-shaped error shows up as a Failure too.
            attempts = getattr(exc, "attempts", 1)
            failure = Failure(
                index=index,
                id=rid or _id_of(item, index),
                error=exc,
                attempts=attempts if isinstance(attempts, int) else 1,
            )
            return index, failure, rid, False
        finally:
            self.running -= 1
        return index, result, rid, False


def _id_of(item: Any, index: int) -> str:
    if isinstance(item, InvalidItem) and item.id is not None:
        return item.id
    own = explicit_id(item)
    if own is not None:
        return own
    return derive_id(item if not isinstance(item, InvalidItem) else repr(item.error), index)


def _open_store(output: Any, resume: bool) -> tuple[JsonlStore | None, dict[str, int]]:
    if output is None:
        if resume:
            raise ValueError("resume=True needs output=: the file to resume from")
        return None, {}
    store = output if isinstance(output, JsonlStore) else JsonlStore(os.fspath(output))
    return store, store.open(resume=resume)


def _total_of(items: Any) -> int | None:
    try:
        return len(items)
    except TypeError:
        return None


async def iter_map(
    client: BatchClient,
    items: Iterable[Any] | AsyncIterable[Any],
    *,
    caller: BatchCaller,
    planner: BatchPlanner,
    on_error: OnError = "return",
    progress: bool | Mapping[str, Any] | None = None,
    output: str | os.PathLike[str] | JsonlStore | None = None,
    resume: bool = False,
    max_tokens: int | None = None,
    urgency: int = 0,
    group: str | None = None,
    timeout: float | UseDefault | None = USE_DEFAULT,
    order: Order = "shape",
    **sampling: Any,
) -> AsyncGenerator[tuple[int, Outcome], None]:
    """Yield ``(index, result or Failure)`` as each item finishes (completion order).

        async with contextlib.aclosing(client.imap(prompts, output="out.jsonl")) as results:
            async for index, result in results:
                ...

    Nothing is kept after an outcome is yielded. Close the iterator in the task that iterates
    it (``aclosing``, or iterate to the end): it runs a task group. Parameters are those of
    :func:`run_map`, without ``ordered``.
    """
    if "ordered" in sampling:
        raise TypeError(
            "imap() yields in completion order; sort by index, or use map(ordered=True)"
        )
    run = _run_batch(
        client,
        caller,
        planner,
        items,
        _Options(
            on_error, progress, output, resume, max_tokens, urgency, group, timeout, sampling, order
        ),
    )
    async with aclosing(run) as outcomes:
        async for index, outcome, _ in outcomes:
            yield index, outcome


async def _open_batch(
    client: BatchClient,
    caller: BatchCaller,
    planner: BatchPlanner,
    items: Iterable[Any] | AsyncIterable[Any],
    options: _Options,
) -> tuple[_Feed, JsonlStore | None, _Run, Progress]:
    """Check the arguments, discover the server, open the output and the bar."""
    if options.on_error not in _ON_ERROR:
        raise ValueError(f"on_error must be 'return' or 'raise', got {options.on_error!r}")
    if options.order not in ORDERS:
        raise ValueError(f"order must be 'shape' or 'input', got {options.order!r}")
    if not isinstance(options.resume, bool):
        raise TypeError(f"resume must be a bool, got {type(options.resume).__name__}")
    check_max_tokens(options.max_tokens)
    caller.timeout_of(options.timeout)  # validates
    source = _Source(items)
    await client.discover()
    store, done_ids = _open_store(options.output, options.resume)
    run = _Run(caller, planner, store, done_ids, options)
    feed: _Feed = (
        _Shaped(source, run, options.window) if options.order == "shape" else _InOrder(source, run)
    )
    try:
        bar: Progress = open_progress(options.progress, total=_total_of(items))
    except BaseException:
        if store is not None:
            store.close()
        raise
    return feed, store, run, bar


async def _run_direct(
    client: BatchClient,
    caller: BatchCaller,
    planner: BatchPlanner,
    items: Iterable[Any] | AsyncIterable[Any],
    sink: Callable[[int, Outcome, bool], None],
    options: _Options,
) -> None:
    """The run behind ``map()`` and ``dsclient map``: each worker settles its own outcomes.

    ``client.limit`` workers each read an item, call, record the outcome (file, bar) and hand
    it to ``sink(index, outcome, read back from the output file)``, in the same task: no
    hand-over to a consumer task, which cost about a fifth of map()'s CPU per item. The input
    is read at most ``limit`` items ahead of what has been settled. The first error that must
    stop the batch (``on_error="raise"``, the input raising, the output failing) cancels the
    other workers and is raised as itself, not as an ``ExceptionGroup``.
    """
    feed, store, run, bar = await _open_batch(client, caller, planner, items, options)
    stop: list[BaseException] = []
    started: _Pool | None = None  # the worker pool, once made
    try:
        async with anyio.create_task_group() as tg:

            async def worker() -> None:
                try:
                    while (got := await feed.next()) is not None:
                        done = await run.process(got)
                        feed.finished(got)
                        sink(*_settle(done, store, bar, run.running, options.on_error))
                        workers.grow()
                except Exception as exc:
                    stop.append(exc)
                    tg.cancel_scope.cancel()

            feed.start(tg)
            started = workers = _Pool(client, feed, lambda: tg.start_soon(worker))
            workers.follow()
    finally:
        if started is not None:
            started.close()
        bar.close()
        if store is not None:
            store.close()
    if stop:
        raise stop[0]


async def _run_batch(
    client: BatchClient,
    caller: BatchCaller,
    planner: BatchPlanner,
    items: Iterable[Any] | AsyncIterable[Any],
    options: _Options,
) -> AsyncGenerator[tuple[int, Outcome, bool], None]:
    """The run behind ``imap()``: yields ``(index, outcome, read back from the output file)``."""
    feed, store, run, bar = await _open_batch(client, caller, planner, items, options)
    # Errors leave the task group only after it is closed, so callers get the original error,
    # not an ExceptionGroup, and aclose() gets its GeneratorExit back.
    stop: BaseException | None = None
    try:
        # A finished outcome waits in the buffer or in its worker: either way the input is read
        # at most workers + buffer items ahead of what has been yielded.
        read = read_ahead(client.limit)
        send, receive = anyio.create_memory_object_stream[_Done | _InputFailed](read)
        async with receive, anyio.create_task_group() as tg:
            # The workers' clones of `send` close the stream when the last one ends, so the pool
            # keeps the original open while it may still start workers.
            feed.start(tg)
            pool = _Pool(
                client,
                feed,
                lambda: tg.start_soon(run.worker, feed, send.clone(), pool),
                on_close=send.close,
            )
            pool.follow()
            while (done := await _receive(receive)) is not None:
                try:
                    index, outcome, resumed = _settle(
                        done, store, bar, run.running, options.on_error
                    )
                except Exception as exc:
                    stop = exc
                    break
                del done
                try:
                    yield index, outcome, resumed
                except BaseException as exc:  # aclose() or athrow() at the yield
                    stop = exc
                    break
                del outcome  # hold nothing while waiting for the next one
            tg.cancel_scope.cancel()
            pool.close()
    finally:
        bar.close()
        if store is not None:
            store.close()
    if stop is not None:
        raise stop


class _Pool:
    """Keeps ``limit + read_ahead(limit)`` workers while the input lasts; grows with the limit.

    ``start()`` starts one worker in the batch's task group. Between :meth:`follow` and
    :meth:`close` a rise of the limit starts workers at once; workers also call :meth:`grow`
    after each item.
    """

    def __init__(
        self,
        client: BatchClient,
        source: _Feed,
        start: Callable[[], object],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._client = client
        self._source = source
        self._start = start
        self._on_close = on_close
        self._workers = 0
        self._remove: Callable[[], None] | None = None
        self._closed = False

    def follow(self) -> None:
        self._remove = self._client.on_limit_raise(self.grow)
        self.grow()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._remove is not None:
            self._remove()
            self._remove = None
        if self._on_close is not None:
            self._on_close()

    def grow(self) -> None:
        """Start workers up to what the limit needs (cheap when there are enough)."""
        if self._closed:
            return
        if self._source.exhausted:
            self.close()
            return
        limit = self._client.limit
        wanted = limit + read_ahead(limit)
        while self._workers < wanted:
            self._workers += 1
            self._start()


async def _receive(receive: MemoryObjectReceiveStream[T]) -> T | None:
    """The next message, or ``None`` at the end; no checkpoint when one is ready."""
    try:
        return receive.receive_nowait()
    except anyio.WouldBlock:
        try:
            return await receive.receive()
        except anyio.EndOfStream:
            return None
    except anyio.EndOfStream:
        return None


def _settle(
    done: _Done | _InputFailed,
    store: JsonlStore | None,
    bar: Progress,
    in_flight: int,
    on_error: OnError,
) -> tuple[int, Outcome, bool]:
    """Record one outcome (file, bar); raises what must stop the batch."""
    if isinstance(done, _InputFailed):
        raise done.error
    index, outcome, rid, resumed = done
    failed = isinstance(outcome, Failure)
    if store is not None and not resumed:
        assert rid is not None
        store.append(index, rid, outcome)
    bar.advance(
        ok=not failed,
        in_flight=in_flight,
        tokens=outcome.usage.completion_tokens if isinstance(outcome, Result) else 0,
        resumed=resumed,
    )
    if isinstance(outcome, Failure) and on_error == "raise":
        raise outcome.error
    return index, outcome, resumed


async def run_map(
    client: BatchClient,
    items: Iterable[Any] | AsyncIterable[Any],
    *,
    caller: BatchCaller,
    planner: BatchPlanner,
    ordered: bool = True,
    on_error: OnError = "return",
    progress: bool | Mapping[str, Any] | None = None,
    output: str | os.PathLike[str] | JsonlStore | None = None,
    resume: bool = False,
    max_tokens: int | None = None,
    urgency: int = 0,
    group: str | None = None,
    timeout: float | UseDefault | None = USE_DEFAULT,
    order: Order = "shape",
    **sampling: Any,
) -> BatchResults:
    """Run every item; return a :class:`BatchResults` list, one entry per item, never dropped.

        results = await client.map(["Hello", "Bonjour"], max_tokens=16, output="out.jsonl")

    Parameters:
        client: the client whose limit the number of workers follows.
        items: prompts, message lists or request dicts, from an iterable or async iterable,
            read lazily (at most the cap plus a small read-ahead beyond what has finished).
        ordered: input order (default); ``False`` returns completion order.
        on_error: ``"return"`` puts a :class:`Failure` in the item's place (bad items too);
            ``"raise"`` stops at the first failure, cancels in-flight calls and raises its error.
        progress: ``None`` draws a bar in a terminal or notebook, ``True``/``False`` force it,
            a dict is passed to tqdm as options.
        output: a JSONL file that gets one line per outcome as it finishes (flushed).
        resume: read ``output`` first: skip the items that succeeded (their results are rebuilt
            from the file), retry those that failed; a torn last line is cut.
        max_tokens, urgency, group, timeout, sampling: as in :meth:`AsyncClient.generate`;
            a request dict's own ``max_tokens`` and sampling keys override them.
        order: the order items *start* in (outcomes keep their input index either way).
            ``"shape"`` (default): within a window of the next 1024 items read, items that
            share a prefix start together (the server computes it once while it is cached),
            and the longest (prompt + ``max_tokens``) first, none waiting more than two
            windows of starts (:mod:`dsclient.batch._order`). ``"input"``: in input order, read one
            at a time.
        caller, planner: the client's own (:class:`~dsclient.client._caller.Caller`: each item's
            call; :class:`~dsclient.client._planner.Planner`: its predicted tokens).
    """
    start = time.perf_counter()
    outcomes: list[Outcome | None] = []
    resumed = 0

    def keep(index: int, outcome: Outcome, from_file: bool) -> None:
        nonlocal resumed
        resumed += from_file
        if not ordered:
            outcomes.append(outcome)
            return
        if index >= len(outcomes):
            outcomes.extend([None] * (index + 1 - len(outcomes)))
        outcomes[index] = outcome

    await _run_direct(
        client,
        caller,
        planner,
        items,
        keep,
        _Options(
            on_error, progress, output, resume, max_tokens, urgency, group, timeout, sampling, order
        ),
    )
    missing = [i for i, o in enumerate(outcomes) if o is None]
    if missing:  # a broken invariant must never look like a short batch
        raise RuntimeError(f"map() lost items {missing[:10]}")
    return BatchResults(
        [o for o in outcomes if o is not None],
        elapsed_s=time.perf_counter() - start,
        resumed=resumed,
    )


def iter_map_blocking(
    portal: BlockingPortal,
    imap: Callable[..., AsyncIterator[tuple[int, Outcome]]],
    items: Any,
    **kwargs: Any,
) -> Iterator[tuple[int, Outcome]]:
    """``imap(items, **kwargs)`` (a client's ``imap``) for synchronous code, run in one task on
    ``portal``'s loop.

    The async iterator runs a task group, so it must be advanced by a single task; this runs
    it in one and hands each outcome over a zero-buffer stream (no read-ahead beyond map's).
    """
    send, receive = anyio.create_memory_object_stream[tuple[int, Outcome]](0)

    async def pump() -> None:
        # imap()'s iterator is iter_map's generator: closed here, in the task that ran it.
        results = cast("AsyncGenerator[tuple[int, Outcome], None]", imap(items, **kwargs))
        async with send, aclosing(results):
            async for pair in results:
                await send.send(pair)

    future = portal.start_task_soon(pump)
    try:
        while True:
            try:
                yield portal.call(receive.receive)
            except anyio.EndOfStream:
                break
    finally:
        portal.call(receive.aclose)
        with contextlib.suppress(anyio.BrokenResourceError):  # the consumer stopped early
            future.result()
