"""The examples in examples/ run against the shared real vLLM server.

``fastapi_app.py`` is driven through its ASGI app (lifespan included, no socket); the batch job
``batch_jsonl.py`` runs as a user runs it, as a script. ``batch.ipynb`` has test_notebook.py.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import anyio
import httpx
import pytest
from asgi_lifespan import LifespanManager

import dsclient

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # pydantic resolves its names there
    spec.loader.exec_module(module)
    return module


def finished_requests(url: str) -> float:
    """How many requests the engine has finished so far (its own counter, any reason)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = re.findall(r"^vllm:request_success_total(?:\{[^}]*\})? (\S+)$", text, flags=re.M)
    assert samples, "vllm:request_success_total is not in /metrics"
    return sum(float(s) for s in samples)


# --- FastAPI ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_fastapi_app_shares_one_client_and_closes_it(vllm_server, monkeypatch):
    monkeypatch.setenv("DSCLIENT_URL", vllm_server.url)
    example = load_example("fastapi_app", monkeypatch)

    callers: list[dsclient.AsyncClient] = []
    generate = dsclient.AsyncClient.generate

    async def spy(self, *args, **kwargs):
        callers.append(self)
        return await generate(self, *args, **kwargs)

    monkeypatch.setattr(dsclient.AsyncClient, "generate", spy)

    n = 12
    replies: dict[int, httpx.Response] = {}
    async with LifespanManager(example.app, startup_timeout=120) as manager:
        client = example.app.state.client
        assert isinstance(client, dsclient.AsyncClient)
        assert client.url == vllm_server.url and client.server.model == "tiny"
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://app", timeout=120
        ) as http:

            async def ask(i: int) -> None:
                body = {"prompt": f"Request {i}: once upon a time", "max_tokens": 8}
                replies[i] = await http.post("/generate", json=body)

            async with anyio.create_task_group() as tg:  # all at once
                for i in range(n):
                    tg.start_soon(ask, i)
            bad = await http.post("/generate", json={"prompt": "", "max_tokens": 8})
        assert sum(lane.done for lane in client.stats().lanes.values()) >= n  # governed
    assert bad.status_code == 422  # an empty prompt never reaches the model server

    assert sorted(replies) == list(range(n))
    for reply in replies.values():
        assert reply.status_code == 200, reply.text
        data = reply.json()
        assert isinstance(data["text"], str) and data["latency_s"] > 0
        assert data["prompt_tokens"] > 0 and 1 <= data["completion_tokens"] <= 8
    # One client for every request: the one the lifespan made ...
    assert len(callers) == n and all(c is client for c in callers)
    # ... and shutting the app down closed it.
    with pytest.raises(RuntimeError, match="closed"):
        await generate(client, "Hello", max_tokens=1)


# --- the JSONL batch job ---------------------------------------------------------------------


def run_batch_job(url: str, requests: Path, output: Path) -> dict:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "batch_jsonl.py"), "--url", url, str(requests), str(output)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, f"stdout:\n{out.stdout[-2000:]}\nstderr:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_batch_jsonl_runs_then_resumes_without_resending(vllm_server, tmp_path):
    url = vllm_server.url
    requests = tmp_path / "requests.jsonl"
    items = [
        {"id": f"q{i}", "prompt": f"Question {i}: what is {i} plus {i}?", "max_tokens": 8}
        for i in range(20)
    ]
    requests.write_text("".join(json.dumps(item) + "\n" for item in items))
    output = tmp_path / "results.jsonl"

    before = finished_requests(url)
    first = run_batch_job(url, requests, output)
    assert (first["count"], first["ok"], first["resumed"], first["sent"]) == (20, 20, 0, 20)
    lines = output.read_text().splitlines()
    assert len(lines) == 20
    records = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in records) == sorted(item["id"] for item in items)
    assert all(r["ok"] and r["usage"]["completion_tokens"] <= 8 for r in records)
    after_first = finished_requests(url)
    assert after_first - before == 20

    # Again: everything is in the output already, so nothing goes to the server.
    second = run_batch_job(url, requests, output)
    assert (second["count"], second["ok"], second["resumed"], second["sent"]) == (20, 20, 20, 0)
    assert output.read_text().splitlines() == lines
    assert finished_requests(url) == after_first

    # A job killed after 15 results: only the 5 missing ones are sent.
    output.write_text("".join(line + "\n" for line in lines[:15]))
    third = run_batch_job(url, requests, output)
    assert (third["count"], third["resumed"], third["sent"]) == (20, 15, 5)
    assert sorted(json.loads(x)["id"] for x in output.read_text().splitlines()) == sorted(
        item["id"] for item in items
    )
    assert finished_requests(url) - after_first == 5
