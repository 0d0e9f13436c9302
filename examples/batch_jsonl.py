"""A resumable batch job: every request in a JSONL file, results to another JSONL file.

    python examples/batch_jsonl.py requests.jsonl results.jsonl --url http://127.0.0.1:8000
    python examples/batch_jsonl.py requests.jsonl results.jsonl   # again after a crash or Ctrl-C

Each input line is one request, as in an OpenAI batch file but flat:
``{"id": "q1", "prompt": "...", "max_tokens": 32}`` (completions) or
``{"id": "c1", "messages": [{"role": "user", "content": "Hi"}]}`` (chat); any other key
(``temperature``, ``top_p``, ...) goes into that request. Each result is appended to the output as
it finishes. Run it again and the requests that already succeeded are not sent again: only the
missing and the failed ones are, so a killed job picks up where it stopped.

Prints one JSON line at the end: count, ok, failed, resumed (taken from the output), sent,
elapsed, items/s, p50/p99 latency. Exits 1 if any request failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio

import dsclient


def read_requests(path: Path) -> Iterator[dict[str, Any]]:
    """The file's requests, one at a time (a file of millions never sits in memory)."""
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError(f"{path}:{number}: a request must be a JSON object")
            yield request


async def run(url: str, requests: Path, output: Path, max_tokens: int) -> dsclient.BatchResults:
    async with dsclient.AsyncClient(url, timeout=300) as client:
        return await client.map(
            read_requests(requests),
            output=output,
            resume=True,  # skip what the output already holds; a new output starts empty
            max_tokens=max_tokens,  # for requests that do not say
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("input", type=Path, help="JSONL file of requests")
    parser.add_argument("output", type=Path, help="JSONL file of results (appended, resumable)")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    parser.add_argument("--max-tokens", type=int, default=64, help="when a request says none")
    args = parser.parse_args(argv)
    results = anyio.run(run, args.url, args.input, args.output, args.max_tokens)
    summary = results.summary()
    summary["sent"] = summary["count"] - summary["resumed"]
    print(json.dumps(summary))
    for failure in results.failures[:5]:
        print(f"failed: {failure.id}: {failure.error}", file=sys.stderr)
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
