"""map() / imap(): order, failures, cancellation, lazy reading, output files and resume."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sys

import anyio
import pytest

import dsclient
from dsclient import AsyncClient, Failure, RequestRefused
from dsclient._display import stats_html
from dsclient._http import httpx
from dsclient.batch import _batch
from dsclient.batch._batch import BatchResults, iter_map_blocking, read_ahead
from dsclient.batch._jsonl import JsonlStore, derive_id, item_id, valid_length
from dsclient.batch._progress import wanted

from .fakes import FakeServer, chat_body, completion_body

pytestmark = pytest.mark.anyio

URL = "http://127.0.0.1:8000"


class EchoServer:
    """Answers completions with the prompt as text, after ``delay(prompt)`` seconds.

    Prompts containing ``"bad"`` are refused with HTTP 400; ``calls`` records the prompts sent.
    """

    def __init__(self, delay=lambda prompt: 0.0, max_num_seqs=None):
        self.models = FakeServer()
        self.delay = delay
        self.calls: list[str] = []
        self.bodies: list[dict] = []
        self.in_server = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path not in ("/v1/completions", "/v1/chat/completions"):
            return self.models(request)
        body = json.loads(request.content)
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        self.calls.append(prompt)
        self.bodies.append(body)
        self.in_server += 1
        try:
            await anyio.sleep(self.delay(prompt))
        finally:
            self.in_server -= 1
        if "bad" in prompt:
            return httpx.Response(400, json={"error": {"message": f"no: {prompt}"}})
        if "messages" in body:
            return httpx.Response(200, json=chat_body(prompt))
        return httpx.Response(
            200, json=completion_body(prompt, prompt_tokens=1, completion_tokens=len(prompt))
        )

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def make_client(server, **kwargs) -> AsyncClient:
    kwargs.setdefault("max_num_seqs", 8)
    return AsyncClient(URL, transport=server.transport, **kwargs)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- order and failures ------------------------------------------------------------------------
async def test_results_come_back_in_input_order():
    # Later items finish first, yet map() returns input order with each result's index.
    server = EchoServer(delay=lambda p: (20 - int(p[1:])) * 0.002)
    prompts = [f"p{i}" for i in range(20)]
    async with make_client(server) as client:
        results = await client.map(prompts, max_tokens=4, progress=False)
    assert isinstance(results, BatchResults)
    assert [r.text for r in results] == prompts
    assert [r.index for r in results] == list(range(20))


async def test_unordered_returns_completion_order():
    server = EchoServer(delay=lambda p: (4 - int(p[1:])) * 0.05)
    async with make_client(server) as client:
        assert client.limit >= 4  # all run at once
        await client.generate("p4", max_tokens=1)  # warm up the tokenizer
        results = await client.map([f"p{i}" for i in range(4)], ordered=False, progress=False)
    assert [r.index for r in results] == [3, 2, 1, 0]


async def test_failures_are_kept_in_place_with_their_index():
    server = EchoServer()
    items = ["ok0", "bad1", "ok2", "", {"temperature": 0.1}, 42, "bad6"]
    async with make_client(server) as client:
        results = await client.map(items, progress=False)
    assert len(results) == len(items)
    assert [r.ok for r in results] == [True, False, True, False, False, False, False]
    refused = results[1]
    assert isinstance(refused, Failure) and isinstance(refused.error, RequestRefused)
    assert (refused.index, refused.text, refused.error.status) == (1, None, 400)
    assert refused.id == derive_id("bad1", 1)
    assert str(results[3].error) == "item 3: prompt is empty"
    assert isinstance(results[4].error, ValueError)
    assert "item 4" in str(results[4].error) and "'prompt' or 'messages'" in str(results[4].error)
    assert isinstance(results[5].error, TypeError) and "item 5" in str(results[5].error)
    assert [f.index for f in results.failures] == [1, 3, 4, 5, 6]
    assert [r.text for r in results.ok] == ["ok0", "ok2"]
    assert server.calls.count("ok0") == 1 and "" not in server.calls  # bad items are not sent


async def test_on_error_raise_stops_and_cancels_in_flight_calls():
    server = EchoServer(delay=lambda p: 0.0 if "bad" in p else 30.0)
    items = ["slow0", "slow1", "bad2", "slow3", "slow4"]
    async with make_client(server) as client:
        with anyio.fail_after(5):  # the slow calls are cancelled, not awaited
            with pytest.raises(RequestRefused) as caught:
                await client.map(items, on_error="raise", progress=False)
        assert caught.value.status == 400
        assert client.in_flight == 0
        await anyio.sleep(0)
        assert server.in_server == 0


async def test_on_error_raise_raises_bad_item_errors_unwrapped():
    async with make_client(EchoServer()) as client:
        with pytest.raises(ValueError, match="item 1: prompt is empty"):
            await client.map(["a", ""], on_error="raise", progress=False)


async def test_arguments_are_validated():
    async with make_client(EchoServer()) as client:
        with pytest.raises(ValueError, match="on_error must be 'return' or 'raise'"):
            await client.map(["a"], on_error="ignore")
        with pytest.raises(TypeError, match="single str"):
            await client.map("abc")
        with pytest.raises(ValueError, match="resume=True needs output="):
            await client.map(["a"], resume=True)
        with pytest.raises(ValueError, match="max_tokens must be > 0"):
            await client.map(["a"], max_tokens=0)
        with pytest.raises(TypeError, match="completion order"):
            async for _ in client.imap(["a"], ordered=True):
                pass


# -- input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("order", "window"), [("input", 0), ("shape", 32)])
async def test_input_is_read_lazily(order, window):
    # order="shape" reads a window ahead of what has started: the bound grows by the window.
    consumed = 0

    def items():
        nonlocal consumed
        for i in range(200):
            consumed += 1
            yield f"p{i}"

    server = EchoServer(delay=lambda p: 0.001)
    async with make_client(server) as client:
        bound = client.limit + 2 * read_ahead(client.limit) + window  # workers + buffer
        yielded = 0
        worst = 0
        options = _batch._Options(
            "return", False, None, False, None, 0, None, None, {}, order, window or 1
        )
        run = _batch._run_batch(client, client._caller, client._planner, items(), options)
        async with contextlib.aclosing(run) as results:
            async for _ in results:
                yielded += 1
                worst = max(worst, consumed - yielded)
                await anyio.sleep(0.0005)  # a slow consumer must not make the reader run ahead
    assert yielded == consumed == 200
    assert worst <= bound, (worst, bound)


@pytest.mark.parametrize(("order", "window"), [("input", 0), ("shape", 32)])
async def test_map_reads_at_most_the_cap_ahead_of_what_is_done(order, window):
    server = EchoServer(delay=lambda p: 0.001 * (int(p[1:]) % 7))
    done = 0
    worst = 0

    def items():
        nonlocal worst
        for i in range(200):
            worst = max(worst, i - done)  # items read before this one, minus those finished
            yield f"p{i}"

    def count(index, outcome, from_file):
        nonlocal done
        done += 1

    async with make_client(server) as client:
        results = await client.map(items(), progress=False)
        assert [r.text for r in results] == [f"p{i}" for i in range(200)]
        # The bound, seen through the runner's hook (map() collects with the same hook).
        worst = 0
        options = _batch._Options(
            "return", False, None, False, None, 0, None, None, {}, order, window or 1
        )
        await _batch._run_direct(client, client._caller, client._planner, items(), count, options)
        assert done == 200
        # Workers: the limit plus a few waiting in the governor (the controller's demand), plus
        # the window order="shape" reads ahead of what has started.
        bound = client.limit + read_ahead(client.limit) + window
        assert 0 < worst <= bound, (worst, client.limit)


async def test_map_stops_with_the_outputs_own_error(tmp_path):
    class FullDisk(JsonlStore):
        def append(self, index, rid, outcome):
            if index >= 3:
                raise OSError(28, "No space left on device")
            super().append(index, rid, outcome)

    store = FullDisk(str(tmp_path / "out.jsonl"))
    server = EchoServer(delay=lambda p: 0.002)
    async with make_client(server) as client:
        with pytest.raises(OSError, match="No space left"):  # itself, not an ExceptionGroup
            await client.map([f"p{i}" for i in range(3)] + ["p3"] * 40, output=store)
        assert client.in_flight == 0
    assert store._out is None  # closed, flushed
    assert sorted(r["index"] for r in lines(tmp_path / "out.jsonl")) == [0, 1, 2]


async def test_async_iterable_input():
    async def items():
        for i in range(30):
            await anyio.sleep(0)
            yield f"a{i}"

    async with make_client(EchoServer(delay=lambda p: 0.001)) as client:
        results = await client.map(items(), progress=False)
    assert [r.text for r in results] == [f"a{i}" for i in range(30)]


async def test_an_input_that_raises_stops_the_batch_with_its_error():
    def items():
        yield "a"
        raise KeyError("input broke")

    async with make_client(EchoServer()) as client:
        with pytest.raises(KeyError, match="input broke"):
            await client.map(items(), progress=False)
        assert client.in_flight == 0


async def test_request_dicts_override_the_calls_parameters():
    server = EchoServer()
    items = [
        {"prompt": "one", "max_tokens": 3, "temperature": 0.9, "id": "x1"},
        {"messages": [{"role": "user", "content": "two"}], "custom_id": "x2"},
        "three",
    ]
    async with make_client(server) as client:
        results = await client.map(items, max_tokens=7, temperature=0.0, progress=False)
    assert [r.text for r in results] == ["one", "two", "three"]
    by_prompt = {b.get("prompt") or b["messages"][0]["content"]: b for b in server.bodies}
    assert by_prompt["one"]["max_tokens"] == 3 and by_prompt["one"]["temperature"] == 0.9
    assert "id" not in by_prompt["one"] and "custom_id" not in by_prompt["two"]
    assert by_prompt["two"]["max_tokens"] == 7 and by_prompt["two"]["temperature"] == 0.0
    assert by_prompt["three"] == {
        "model": "tiny",
        "prompt": "three",
        "max_tokens": 7,
        "temperature": 0.0,
    }
    assert isinstance(results[1], dsclient.ChatResult)


# -- output and resume ---------------------------------------------------------------------------
async def test_output_gets_one_line_per_item(tmp_path):
    out = tmp_path / "results.jsonl"
    items = ["p0", {"prompt": "bad1", "id": "mine"}, "p2"]
    async with make_client(EchoServer()) as client:
        await client.map(items, output=out, max_tokens=5, progress=False)
    records = sorted(lines(out), key=lambda r: r["index"])
    assert [r["index"] for r in records] == [0, 1, 2]
    ok = records[0]
    assert ok["id"] == derive_id("p0", 0) and ok["ok"] is True and ok["text"] == "p0"
    assert ok["usage"] == {"prompt_tokens": 1, "completion_tokens": 2}
    assert ok["finish_reason"] == "length" and ok["attempts"] == 1 and ok["max_tokens"] == 5
    assert ok["latency_s"] >= 0 and ok["kind"] == "completion"
    failed = records[1]
    assert failed["id"] == "mine" and failed["ok"] is False
    assert failed["error"]["type"] == "RequestRefused" and failed["error"]["status"] == 400


async def test_an_existing_output_needs_resume(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text('{"index": 0}\n')
    async with make_client(EchoServer()) as client:
        with pytest.raises(FileExistsError, match="resume=True"):
            await client.map(["a"], output=out, progress=False)


async def test_resume_skips_successes_and_retries_failures(tmp_path):
    out = tmp_path / "results.jsonl"
    items = [f"p{i}" for i in range(10)]
    first = EchoServer()
    flaky = [f"bad{i}" if i % 3 == 0 else f"p{i}" for i in range(10)]  # 0, 3, 6, 9 fail
    ids = [item_id(p, i) for i, p in enumerate(items)]
    # The first run sees the flaky prompts under the real items' ids.
    flaky_items = [{"prompt": p, "id": ids[i]} for i, p in enumerate(flaky)]
    async with make_client(first) as client:
        results = await client.map(flaky_items, output=out, progress=False)
    assert len(results.failures) == 4

    second = EchoServer()
    async with make_client(second) as client:
        results = await client.map(items, output=out, resume=True, progress=False)
    assert sorted(second.calls) == ["p0", "p3", "p6", "p9"]  # only the failures ran again
    assert [r.text for r in results] == items
    assert [r.index for r in results] == list(range(10))
    assert results.resumed == 6 and not results.failures
    successes = [r for r in lines(out) if r["ok"]]
    assert sorted(r["id"] for r in successes) == sorted(ids)  # exactly one success per item

    third = EchoServer()
    async with make_client(third) as client:
        again = await client.map(items, output=out, resume=True, progress=False)
    assert third.calls == [] and again.resumed == 10
    assert [r.text for r in again] == [r.text for r in results]
    rebuilt = again[1]
    assert rebuilt.raw.choices[0].text == "p1" and rebuilt.raw.usage.completion_tokens == 2


async def test_resume_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "results.jsonl"
    items = ["a", "b", "c"]
    async with make_client(EchoServer()) as client:
        await client.map(items[:2], output=out, progress=False)
    whole = out.read_bytes()
    out.write_bytes(whole + b'{"index": 2, "id": "2-abc", "ok": tr')  # kill -9 mid-line
    server = EchoServer()
    async with make_client(server) as client:
        results = await client.map(items, output=out, resume=True, progress=False)
    assert server.calls == ["c"]
    assert [r.text for r in results] == items
    text = out.read_text()
    assert text.endswith("\n") and text.startswith(whole.decode())
    assert sorted(r["index"] for r in lines(out)) == [0, 1, 2]


def test_valid_length_finds_the_last_whole_line():
    assert valid_length(b'{"a":1}\n{"b":', 13) == 8
    assert valid_length(b'{"a":1}\n', 8) == 8
    assert valid_length(b'x\n{"a":1}\n', 100) == 100
    assert valid_length(b"", 0) == 0


def test_ids_are_stable_across_rereads():
    def read():
        yield "same"
        yield "same"
        yield {"messages": [{"content": "hi", "role": "user"}], "temperature": 0.5}
        yield {"prompt": "x", "custom_id": "given"}
        yield {"prompt": "x", "id": 7}

    first = [item_id(item, i) for i, item in enumerate(read())]
    second = [item_id(item, i) for i, item in enumerate(read())]
    assert first == second
    assert first[0] != first[1]  # identical items are told apart by their index
    assert first[3:] == ["given", "7"]
    # canonical JSON: key order does not matter
    assert derive_id({"a": 1, "b": 2}, 0) == derive_id({"b": 2, "a": 1}, 0)
    assert derive_id("edited", 2) != derive_id("original", 2)


async def test_flat_memory_imap_holds_nothing_after_yield(tmp_path):
    out = tmp_path / "big.jsonl"
    n = 2000
    async with make_client(EchoServer()) as client:
        count = 0
        async for index, result in client.imap(
            (f"p{i}" for i in range(n)), output=out, progress=False
        ):
            count += 1
    assert count == n
    assert len(out.read_text().splitlines()) == n


async def test_a_store_object_can_be_passed_as_output(tmp_path):
    store = JsonlStore(tmp_path / "s.jsonl", fsync_interval=None)
    async with make_client(EchoServer()) as client:
        await client.map(["a"], output=store, progress=False)
    assert lines(tmp_path / "s.jsonl")[0]["text"] == "a"


# -- progress and display ------------------------------------------------------------------------
async def test_progress_bar_shows_done_failed_and_in_flight():
    buf = io.StringIO()
    async with make_client(EchoServer()) as client:
        await client.map(["a", "bad", "c"], progress={"file": buf, "mininterval": 0})
    text = buf.getvalue()
    assert "3/3" in text and "failed=1" in text and "in_flight=" in text and "tok/s=" in text


async def test_progress_off_draws_nothing(monkeypatch):
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stderr", buf)
    async with make_client(EchoServer()) as client:
        await client.map(["a"], progress=False)
        await client.map(["a"])  # auto: stderr is not a terminal, no notebook
    assert buf.getvalue() == ""


def test_progress_auto_setting(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert wanted(None) is False and wanted(True) is True and wanted({"file": None}) is True
    monkeypatch.setattr(sys, "stderr", Tty())
    assert wanted(None) is True and wanted(False) is False
    with pytest.raises(TypeError, match="progress must be"):
        wanted("yes")


async def test_batch_results_summary_and_html():
    async with make_client(EchoServer()) as client:
        results = await client.map(["a", "bad"], progress=False)
        stats = client.stats()
    summary = results.summary()
    assert (summary["count"], summary["ok"], summary["failed"]) == (2, 1, 1)
    assert summary["p50_latency_s"] is not None and summary["items_per_s"] > 0
    html = results._repr_html_()
    assert "<table>" in html and "RequestRefused" in html
    assert "2 items: 1 ok, 1 failed" in repr(results)
    table = stats_html(stats)
    assert "<td>short</td>" in table and "p99" in table
    # The limit control heads the table: mode, limit, why it last moved, the server's queue.
    assert "<th>last change</th>" in table and "<td>throughput</td>" in table
    assert "<td>start</td>" in table and "<th>server waiting</th>" in table


# -- the synchronous client, as in a notebook cell ---------------------------------------------
def test_sync_map_inside_a_running_event_loop():
    buf = io.StringIO()

    async def cell():
        with dsclient.Client(URL, transport=EchoServer().transport, max_num_seqs=4) as client:
            results = client.map(["x", "y"], progress={"file": buf, "mininterval": 0})
            return [r.text for r in results], client.in_flight

    assert asyncio.run(cell()) == (["x", "y"], 0)
    assert "2/2" in buf.getvalue()


def test_iter_map_blocking_runs_in_one_task_and_stops_early():
    with dsclient.Client(URL, transport=EchoServer().transport, max_num_seqs=4) as client:
        portal = client._portal
        got = sorted(
            i
            for i, _ in iter_map_blocking(
                portal, client.aclient.imap, ["a", "b", "c"], progress=False
            )
        )
        assert got == [0, 1, 2]
        early = iter_map_blocking(
            portal, client.aclient.imap, (f"p{i}" for i in range(100)), progress=False
        )
        next(early)
        early.close()
        assert client.in_flight == 0


class MetricsEchoServer(EchoServer):
    """An EchoServer with vLLM-style gauges: a batch of ``batch`` sequences, the rest queued."""

    def __init__(self, delay, batch: int):
        super().__init__(delay)
        self.batch = batch
        self.most = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            running = min(self.in_server, self.batch)
            waiting = self.in_server - running
            text = (
                f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {running}.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="tiny"}} {waiting}.0\n'
            )
            return httpx.Response(200, text=text)
        self.most = max(self.most, self.in_server + 1)
        return await super().__call__(request)


async def test_map_follows_the_limit_as_it_rises():
    # Starts at 5 (0.7 x 8); the server shows a batch of 16 with room, so the limit grows and
    # map() adds workers: more than the starting 5 + 2 run at once.
    server = MetricsEchoServer(delay=lambda p: 0.02, batch=16)
    async with make_client(server, scrape_interval=0.05) as client:
        assert client.limit == 5
        results = await client.map([f"p{i}" for i in range(400)], progress=False)
        grown = client.limit
    assert [r.text for r in results] == [f"p{i}" for i in range(400)]
    assert grown > 5
    assert server.most > 5 + read_ahead(5)


# -- the start order (order="shape", dsclient/batch/_order.py) ---------------------------------
def _prefix_heavy(n_prefixes: int = 4, per_prefix: int = 6) -> list[str]:
    """Shuffled prompts on ``n_prefixes`` system prompts of 600 characters (2 whole blocks)."""
    import random

    systems = [f"System {p}: " + f"rule {p} applies. " * 40 for p in range(n_prefixes)]
    prompts = [s + f"Question {q}?" for s in systems for q in range(per_prefix)]
    random.Random(4).shuffle(prompts)
    return prompts


def _runs(prompts: list[str]) -> int:
    heads = [p.split(":")[0] for p in prompts]
    return sum(1 for i, h in enumerate(heads) if i == 0 or h != heads[i - 1])


@pytest.mark.parametrize("order", ["shape", "input"])
async def test_shape_order_sends_shared_prefixes_together_and_keeps_output_order(order):
    prompts = _prefix_heavy()
    server = EchoServer()
    # Limit 1: the calls reach the server in the order the items start.
    async with make_client(server, max_num_seqs=1) as client:
        results = await client.map(prompts, max_tokens=4, progress=False, order=order)
    assert [r.text for r in results] == prompts
    assert [r.index for r in results] == list(range(len(prompts)))
    assert sorted(server.calls) == sorted(prompts)
    if order == "input":
        assert server.calls == prompts
    else:
        assert _runs(server.calls) == 4 < _runs(prompts)


async def test_shape_order_starts_the_longest_first():
    prompts = ["short"] * 5 + ["long"] + ["short"] * 5
    server = EchoServer()
    # 100 tokens out is still the short lane (a long-lane call may wait behind short ones).
    items = [
        {"prompt": f"{p} {i}", "max_tokens": 100 if p == "long" else 8}
        for i, p in enumerate(prompts)
    ]
    async with make_client(server, max_num_seqs=1) as client:
        results = await client.map(items, progress=False)
    assert server.calls[0] == "long 5"
    assert [r.index for r in results] == list(range(11))


@pytest.mark.parametrize("order", ["shape", "input"])
async def test_where_the_context_is_unknown_a_batchs_long_items_take_the_long_lane(order):
    # The server says no context: long is judged beside the calls seen (RecentSizes). Started
    # longest first, the long items would be planned before any short one was seen, under the
    # fallback of 1024 tokens, and take the short lane; the batch's read items count first.
    server = EchoServer()
    server.models = FakeServer(max_model_len=None)
    items = [{"prompt": f"short {i}", "max_tokens": 8} for i in range(12)]
    items[5:5] = [{"prompt": f"long {i}", "max_tokens": 300} for i in range(3)]
    async with make_client(server, max_num_seqs=4) as client:
        results = await client.map(items, progress=False, order=order)
    assert server.calls[0].startswith("long" if order == "shape" else "short")
    lanes = {r.text.split()[0]: set() for r in results}
    for r in results:
        lanes[r.text.split()[0]].add(r.lane)
    assert lanes == {"long": {"long"}, "short": {"short"}}


def _long_items_first() -> tuple[EchoServer, dict[str, float], list[dict]]:
    """A server that takes 0.5 s a long call and 0.01 s a short one, noting when each started,
    and a batch of 12 long items ahead of 40 short ones."""
    started: dict[str, float] = {}
    t0 = anyio.current_time()

    def delay(prompt: str) -> float:
        started.setdefault(prompt, anyio.current_time() - t0)
        return 0.5 if prompt.startswith("long") else 0.01

    items = [{"prompt": f"long {i}", "max_tokens": 300} for i in range(12)]
    items += [{"prompt": f"short {i}", "max_tokens": 8} for i in range(40)]
    return EchoServer(delay=delay), started, items


def _assert_short_items_ran_beside_the_long_ones(started: dict[str, float]) -> None:
    first = min(started.values())
    first_long_done = min(t for p, t in started.items() if p.startswith("long")) + 0.5
    shorts = [t for p, t in started.items() if p.startswith("short")]
    assert min(shorts) - first < 0.2 < first_long_done - first
    assert sum(1 for t in shorts if t < first_long_done) >= 20


@pytest.mark.parametrize(("via", "servers"), [("map", 1), ("imap", 1), ("map", 2)])
async def test_shape_order_runs_short_items_while_its_long_ones_wait_for_the_long_lane(
    via, servers
):
    # Longest first puts the 12 long items at the head of the round. Were every worker to take
    # one, those beyond the long lane's cap would wait in the client, holding the workers the
    # short items need, and the server would run long items only until the first of them ended.
    # Instead short items start at once beside the long ones.
    server, started, items = _long_items_first()
    urls = URL if servers == 1 else [URL, "http://127.0.0.1:8001"]
    client = AsyncClient(
        urls, transport=server.transport, max_num_seqs=8, limit=8, long_threshold=200
    )
    async with client:
        if via == "map":
            results = await client.map(items, progress=False)
            assert [r.index for r in results] == list(range(52))
        else:
            async with contextlib.aclosing(client.imap(items, progress=False)) as outcomes:
                assert sorted([index async for index, _ in outcomes]) == list(range(52))
    assert server.calls[0].startswith("long")
    _assert_short_items_ran_beside_the_long_ones(started)


async def test_long_items_read_before_any_short_one_still_leave_workers_to_short_items():
    # The server says no context: what is long is judged beside the sizes read. Items read
    # before four short ones were seen are judged under the fallback (1024 tokens); judged
    # then, the 12 long items at the head of the input counted as short in the hand-out, every
    # worker took one, and no short item started until the first long one ended.
    server, started, items = _long_items_first()
    server.models = FakeServer(max_model_len=None)
    async with make_client(server, max_num_seqs=8, limit=8) as client:
        results = await client.map(items, progress=False)
    assert [r.index for r in results] == list(range(52))
    assert {r.lane for r in results if r.text.startswith("long")} == {"long"}
    _assert_short_items_ran_beside_the_long_ones(started)


async def test_shape_order_resumes_the_same_ids_exactly_once(tmp_path):
    # A first run in input order that fails some items, resumed in shape order: the ids match,
    # the successes are read back and only the failures are sent again.
    out = tmp_path / "out.jsonl"
    prompts = [
        p if i % 3 else p.replace("Question", "bad Question") for i, p in enumerate(_prefix_heavy())
    ]
    async with make_client(EchoServer()) as client:
        first = await client.map(prompts, output=out, progress=False, order="input")
    assert len(first.failures) == 8
    server = EchoServer()
    async with make_client(server) as client:
        again = await client.map(prompts, output=out, resume=True, progress=False)
    assert again.resumed == 16
    assert sorted(server.calls) == sorted(p for p in prompts if "bad" in p)
    assert [r.index for r in again] == list(range(24))
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert len(ids) == 24 + 8 and len(set(ids)) == 24


async def test_shape_order_does_not_wait_for_a_slow_async_input_to_fill_the_window():
    # An input that yields the next item only after the previous one's result came back: a
    # window that waited to fill would never start the first.
    answered = anyio.Event()
    seen = []

    async def items():
        for i in range(3):
            yield f"p{i}"
            await answered.wait()

    server = EchoServer()
    async with make_client(server) as client:
        with anyio.fail_after(10):
            async with contextlib.aclosing(client.imap(items(), progress=False)) as results:
                async for index, result in results:
                    seen.append(index)
                    answered.set()
    assert sorted(seen) == [0, 1, 2]


async def test_shape_order_wakes_one_waiting_worker_per_item_of_an_async_input(monkeypatch):
    # 200 workers wait for an async input that yields one item at a time. Each item must wake
    # one of them, not all: one Event for all woke every worker at every item, and at 1024 in
    # flight map() spent about 10 ms of CPU per item on workers that found nothing.
    real_event = anyio.Event
    waits = 0

    class CountingEvent:
        def __init__(self) -> None:
            self._event = real_event()

        def set(self) -> None:
            self._event.set()

        def is_set(self) -> bool:
            return self._event.is_set()

        async def wait(self) -> None:
            nonlocal waits
            waits += 1
            await self._event.wait()

    async def items():
        for i in range(300):
            await anyio.sleep(0)  # the workers run between items
            yield f"p{i}"

    monkeypatch.setattr("dsclient.batch._batch.anyio.Event", CountingEvent)
    server = EchoServer(delay=lambda prompt: 0.001)
    async with make_client(server, limit=160) as client:  # 160 + read-ahead 40 workers
        with anyio.fail_after(30):
            results = await client.map(items(), progress=False)
    assert [r.text for r in results] == [f"p{i}" for i in range(300)]
    assert waits <= 2 * 300 + 200, waits  # about one wait per item and per worker at the end


async def test_shape_order_raises_an_async_inputs_error():
    async def items():
        yield "p0"
        raise OSError("disk gone")

    async with make_client(EchoServer()) as client:
        with pytest.raises(OSError, match="disk gone"):
            await client.map(items(), progress=False)


async def test_order_is_checked():
    async with make_client(EchoServer()) as client:
        with pytest.raises(ValueError, match="order must be"):
            await client.map(["a"], order="random", progress=False)


@pytest.mark.parametrize("order", ["shape", "input"])
async def test_on_two_servers_each_sees_a_prefix_group_together(order):
    # The router puts a call where there is room first, so a group started together spreads
    # over both servers when it is larger than one's room; but each server then gets the
    # group's items one after another, and computes the prefix once rather than once per
    # eviction. As read, the prefixes interleave on each server.
    from tests.test_pool import Replica, client_for

    a, b = Replica("a", delay=0.005), Replica("b", delay=0.005)
    prompts = _prefix_heavy(n_prefixes=6, per_prefix=8)
    async with client_for([a, b], limit=2) as client:
        results = await client.map(prompts, max_tokens=4, progress=False, order=order)
    assert not results.failures and [r.index for r in results] == list(range(48))
    runs = [_runs(r.seen) for r in (a, b)]
    if order == "shape":
        assert max(runs) <= 6 + 1, runs
    else:
        assert min(runs) > 12, runs
