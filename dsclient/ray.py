"""Batch jobs on Ray Data: one governed dsclient client per actor of ``map_batches``.

    import ray
    from dsclient.ray import Generate, map_dataset

    ds = ray.data.from_items([{"prompt": "Once upon a time"}, {"prompt": "The sea"}])
    out = map_dataset(ds, "http://127.0.0.1:8000", actors=2, max_tokens=32)
    # or, spelled out (Ray 2.51+ takes compute=; before, concurrency=2 did the same):
    out = ds.map_batches(
        Generate,
        fn_constructor_args=("http://127.0.0.1:8000",),
        fn_constructor_kwargs={"max_tokens": 32, "shared": "redis://127.0.0.1:6379/0"},
        batch_format="pyarrow",
        batch_size=64,
        compute=ray.data.ActorPoolStrategy(size=2),
    )

Each actor builds one :class:`dsclient.AsyncClient` on the event loop Ray Data keeps for an
async callable class (its ``__call__`` is an async generator, which Ray Data runs on one loop per
actor, a few batches at a time), and sends each batch's rows through ``client.map()``: the
client's governor orders them, retries them and keeps the server's queue short. With
``shared="redis://..."`` every actor's client draws from one in-flight budget in Redis, so the
actors together respect the server instead of each taking the whole limit.

Every input row comes back once, with the answer, the usage, the latency and, for a row that
failed, an ``error`` column (``"ContextOverflow: ..."``): a failed call is a row, never an
exception that kills the job. Only mistakes in the job itself (a missing input column, an output
column that already exists, a bad client option) raise.

The output columns (rename with ``columns={"answer": "summary"}``, drop with ``None``):

===================== ========== =============================================================
``answer``            string     the generated text; null on error rows
``error``             string     ``"TypeName: message"`` of the failure; null when it worked
``finish_reason``     string     the server's ``finish_reason``; null on error rows
``prompt_tokens``     int64      usage the server reported; null on error rows
``completion_tokens`` int64      likewise
``latency_s``         float64    the call's time, waiting for a slot included; null on errors
``queued_s``          float64    the part of it spent waiting in the client's governor
``attempts``          int64      tries the call took (error rows too)
===================== ========== =============================================================

Batches come back as ``pyarrow.Table`` whatever format they came in, with these types: Ray Data
turns an all-null numpy or pandas column into Arrow's ``null`` type, which a later block with
strings cannot be merged with (``write_parquet`` then fails to read back).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

try:
    import pyarrow as pa
    import ray
    import ray.data
except ImportError as exc:  # tests/test_ray.py blocks the import to see this message
    raise ImportError(
        f"dsclient.ray needs Ray Data ({exc.name or 'ray'} is missing): pip install 'dsclient[ray]'"
    ) from exc

from ._models import Failure, Result
from .client._client import USE_DEFAULT, AsyncClient

__all__ = ["OUTPUT_COLUMNS", "Generate", "error_text", "map_dataset", "outcome_table", "to_item"]

logger = logging.getLogger("dsclient")

#: The output columns by their default names, with their Arrow types.
OUTPUT_COLUMNS: Mapping[str, pa.DataType] = {
    "answer": pa.string(),
    "error": pa.string(),
    "finish_reason": pa.string(),
    "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
    "latency_s": pa.float64(),
    "queued_s": pa.float64(),
    "attempts": pa.int64(),
}


def error_text(error: BaseException) -> str:
    """The ``error`` column's text for a failure: the exception's type name and message.

    error_text(ValueError("bad"))  # "ValueError: bad"
    """
    message = str(error)
    name = type(error).__name__
    return f"{name}: {message}" if message else name


def to_item(value: Any) -> Any:
    """A cell of the input column as ``client.map()`` takes it: plain Python, no numpy.

        to_item(np.array([{"role": "user", "content": "Hi"}]))  # [{"role": "user", ...}]

    Ray Data hands list columns over as numpy arrays (of dicts, for messages) and numbers as
    numpy scalars; ``map()`` wants a ``str`` prompt, a list of message dicts or a request dict.
    Null fields of a dict are dropped: Arrow fills a struct column's missing fields with nulls.
    Anything else goes through as it is, and ``map()`` reports it as that row's error.
    """
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        # Arrow gives a struct column every field of every row, null where a row had none:
        # a null field is an absent one (a message's "name", a request's "temperature").
        return {key: to_item(item) for key, item in value.items() if item is not None}
    if isinstance(value, (list, tuple)) or type(value).__module__ == "numpy":
        tolist = getattr(value, "tolist", None)
        plain = tolist() if tolist is not None else value
        if isinstance(plain, (list, tuple)):
            return [to_item(item) for item in plain]
        return plain  # a numpy scalar: its Python value
    return value


def _cell(outcome: Result | Failure, column: str) -> Any:
    if isinstance(outcome, Failure):
        if column == "error":
            return error_text(outcome.error)
        if column == "attempts":
            return outcome.attempts
        return None
    if column == "answer":
        return outcome.text
    if column == "error":
        return None
    if column in ("prompt_tokens", "completion_tokens"):
        return getattr(outcome.usage, column)
    return getattr(outcome, column)


def outcome_table(
    outcomes: Sequence[Result | Failure], names: Mapping[str, str | None] | None = None
) -> pa.Table:
    """The output columns for ``outcomes`` (one row each, in order) as a typed Arrow table.

        outcome_table(await client.map(prompts), {"answer": "summary", "queued_s": None})

    Parameters:
        outcomes: what ``client.map()`` returned for a batch.
        names: output column -> its name in the table, or ``None`` to leave it out; columns
            not named keep their default names (the keys of :data:`OUTPUT_COLUMNS`).
    """
    names = _column_names(names)
    arrays: dict[str, pa.Array] = {}
    for column, kind in OUTPUT_COLUMNS.items():
        name = names[column]
        if name is not None:
            arrays[name] = pa.array([_cell(o, column) for o in outcomes], type=kind)
    return pa.table(arrays) if arrays else pa.table({}, schema=pa.schema([]))


def _column_names(names: Mapping[str, str | None] | None) -> dict[str, str | None]:
    chosen: dict[str, str | None] = {column: column for column in OUTPUT_COLUMNS}
    for column, name in (names or {}).items():
        if column not in OUTPUT_COLUMNS:
            raise ValueError(
                f"columns: unknown output column {column!r}; the output columns are "
                f"{', '.join(OUTPUT_COLUMNS)}"
            )
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"columns: the name for {column!r} must be a non-empty str or None")
        chosen[column] = name
    taken = [name for name in chosen.values() if name is not None]
    if len(set(taken)) != len(taken):
        raise ValueError(f"columns: two output columns share a name: {sorted(taken)}")
    return chosen


def _as_table(batch: Any) -> pa.Table:
    """Any batch Ray Data hands a UDF (pyarrow, pandas, dict of numpy arrays) as an Arrow table,
    converted the way Ray Data converts a UDF's own output (numpy object columns it cannot
    type are kept as pickled Python objects)."""
    if isinstance(batch, pa.Table):
        return batch
    from ray.data.block import BlockAccessor

    block = BlockAccessor.batch_to_block(batch)
    if isinstance(block, pa.Table):
        return block
    table = BlockAccessor.for_block(block).to_arrow()
    assert isinstance(table, pa.Table)
    return table


class Generate:
    """A Ray Data callable class: sends each row's prompt through one dsclient client per actor.

        ds.map_batches(
            Generate,
            fn_constructor_args=("http://127.0.0.1:8000",),
            fn_constructor_kwargs={"column": "prompt", "max_tokens": 32},
            batch_format="pyarrow",
            compute=ray.data.ActorPoolStrategy(size=2),
        )

    Parameters:
        url: the server's URL (as for :class:`dsclient.AsyncClient`).
        column: the input column; each cell is a prompt (``str``, completions endpoint), a list
            of chat messages (chat endpoint) or a request dict as ``client.map()`` takes it.
        columns: rename output columns (``{"answer": "summary"}``) or leave them out (``None``);
            see the module's table for the defaults.
        max_tokens: as in :meth:`dsclient.AsyncClient.generate` (cut to the room left).
        timeout: seconds for each call (default: the client's).
        shared: a Redis URL: every actor's client shares one in-flight budget for the server
            (``AsyncClient(shared=...)``), so N actors do not each take the whole limit.
        shared_key: the key prefix of that budget in Redis (several budgets on one Redis).
        client_options: any other :class:`dsclient.AsyncClient` keyword (``limit``,
            ``latency_target``, ``api_key``, ``retry``, ...).
        sampling: anything else goes into each request body (``temperature``, ``ignore_eos``).
    """

    def __init__(
        self,
        url: str,
        *,
        column: str = "prompt",
        columns: Mapping[str, str | None] | None = None,
        max_tokens: int | None = None,
        timeout: Any = USE_DEFAULT,
        shared: str | None = None,
        shared_key: str | None = None,
        client_options: Mapping[str, Any] | None = None,
        **sampling: Any,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise TypeError(f"url must be the server's URL as a str, got {url!r}")
        if not isinstance(column, str) or not column:
            raise ValueError(f"column must be the input column's name, got {column!r}")
        self._url = url
        self._column = column
        self._names = _column_names(columns)
        self._call: dict[str, Any] = {"max_tokens": max_tokens, "timeout": timeout, **sampling}
        options = dict(client_options or {})
        # Passed only when set, so a client without the shared budget still takes the rest.
        if shared is not None:
            options["shared"] = shared
        if shared_key is not None:
            options["shared_key"] = shared_key
        self._options = options
        self._client: AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[AsyncClient] | None = None
        self._stop: asyncio.Event | None = None
        self._owner: asyncio.Task[None] | None = None

    @property
    def client(self) -> AsyncClient | None:
        """The actor's client once the first batch opened it (``None`` before)."""
        return self._client

    async def _get_client(self) -> AsyncClient:
        """The actor's client, opened (``async with``) by one task of its own on first use.

        Ray Data runs an async class's batches as separate tasks on one loop per actor, and
        builds the class elsewhere; an ``async with`` client (its poller, and with ``shared=``
        its first lease, which waits for room in the budget) must open and close in one task,
        so a task of its own holds it open until :meth:`aclose`. No await between the check
        and the assignment: the batches running at once share the one client.
        """
        if self._ready is None:
            # Made here, not in __init__, so a mistake in the options raises on the first batch
            # (the constructor runs in Ray's actor set-up, outside this loop).
            client = AsyncClient(self._url, **self._options)
            loop = asyncio.get_running_loop()
            self._loop = loop
            self._ready = loop.create_future()
            self._stop = asyncio.Event()
            self._owner = loop.create_task(self._hold(client, self._ready, self._stop))
        ready = self._ready
        try:
            # shield: a cancelled batch must not cancel the future the other batches wait on.
            return await asyncio.shield(ready)
        except Exception:
            if self._ready is ready:
                self._ready = None  # the next batch opens a new client
            raise

    async def _hold(
        self, client: AsyncClient, ready: asyncio.Future[AsyncClient], stop: asyncio.Event
    ) -> None:
        try:
            async with client:
                self._client = client
                ready.set_result(client)
                await stop.wait()
        except Exception as exc:
            if not ready.done():
                ready.set_exception(exc)  # opening failed: the batches waiting get the error
            else:
                logger.warning("dsclient.ray: closing the actor's client failed: %s", exc)
        finally:
            self._client = None

    async def __call__(self, batch: Any) -> AsyncIterator[pa.Table]:
        """Answer one batch: the input columns, then the output columns, one row per input row."""
        table = _as_table(batch)
        if self._column not in table.column_names:
            raise ValueError(
                f"dsclient.ray.Generate: no column {self._column!r} in the batch (columns: "
                f"{', '.join(table.column_names)}); pass column= with the prompt's column"
            )
        clash = [
            name for name in self._names.values() if name is not None and name in table.column_names
        ]
        if clash:
            raise ValueError(
                f"dsclient.ray.Generate: output column(s) {clash} already exist in the dataset; "
                "rename them with columns={...: 'new_name'}"
            )
        items = [to_item(value) for value in table.column(self._column).to_pylist()]
        outcomes = await self._run(items)
        for name, array in zip(
            (n for n in self._names.values() if n is not None),
            outcome_table(outcomes, self._names).columns,
            strict=True,
        ):
            table = table.append_column(name, array)
        yield table

    async def _run(self, items: list[Any]) -> Sequence[Result | Failure]:
        try:
            client = await self._get_client()
            return await client.map(items, progress=False, on_error="return", **self._call)
        except (TypeError, ValueError, ImportError):
            # A mistake in the job (a bad option, redis-py missing for shared=, several models
            # and none chosen): say so at once rather than fail every row alike.
            raise
        except Exception as exc:
            # map() returns per-row failures; one that raises lost the whole batch (the server
            # was never reachable, say). Every row of it becomes an error row.
            logger.warning("dsclient.ray: a batch of %d rows failed: %s", len(items), exc)
            return [Failure(index=i, error=exc) for i in range(len(items))]

    async def aclose(self) -> None:
        """Close the actor's client, on the loop it runs on.

        With ``shared=``, closing hands the actor's share of the budget back at once rather than
        when its leases expire.
        """
        owner, stop, self._owner, self._ready = self._owner, self._stop, None, None
        if owner is None or stop is None:
            return
        stop.set()
        await owner

    def close(self) -> None:
        """:meth:`aclose` from outside the actor's loop (Ray Data's ``__del__`` at actor exit)."""
        loop = self._loop
        if self._owner is None or loop is None or loop.is_closed() or not loop.is_running():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # on the loop itself: it cannot be waited for here
            loop.create_task(self.aclose())
            return
        future = asyncio.run_coroutine_threadsafe(self.aclose(), loop)
        try:
            future.result(timeout=10.0)
        except Exception as exc:  # never let shutting an actor down fail on this
            logger.debug("dsclient.ray: closing the client failed: %s", exc)

    def __del__(self) -> None:
        # Nothing sensible to do about a failure while the actor is being torn down.
        with contextlib.suppress(Exception):
            self.close()


def map_dataset(
    ds: ray.data.Dataset,
    url: str,
    *,
    actors: int = 2,
    batch_size: int = 64,
    num_cpus: float = 0.5,
    **options: Any,
) -> ray.data.Dataset:
    """``ds.map_batches`` with :class:`Generate` on a pool of ``actors`` actors.

        out = map_dataset(ds, "http://127.0.0.1:8000", actors=4, max_tokens=32,
                          shared="redis://127.0.0.1:6379/0")

    Parameters:
        ds: the dataset; its ``column`` (default ``"prompt"``) holds the prompts.
        url: the server's URL.
        actors: the size of the actor pool (``compute=ray.data.ActorPoolStrategy(size=...)``;
            before Ray 2.51, ``concurrency=actors`` says the same).
        batch_size: rows per batch; each actor runs a few batches at once, so its client has
            rows waiting whenever a slot frees.
        num_cpus: CPUs Ray reserves per actor; the work is waiting on the server, so a share of
            one core is enough (Ray's default of 1 would leave a 2-core machine nothing else).
        options: :class:`Generate`'s keywords (``column``, ``columns``, ``max_tokens``,
            ``shared``, ``client_options``, sampling).
    """
    if isinstance(actors, bool) or not isinstance(actors, int) or actors < 1:
        raise ValueError(f"actors must be an int >= 1, got {actors!r}")
    Generate(url, **options)  # check the options here, not in the actors
    return ds.map_batches(
        Generate,
        fn_constructor_args=(url,),
        fn_constructor_kwargs=options,
        batch_format="pyarrow",
        batch_size=batch_size,
        num_cpus=num_cpus,
        compute=ray.data.ActorPoolStrategy(size=actors),
    )
