"""One client process of the shared-budget tests and benchmark: ``python -m
tests.integration.shared_worker URL REDIS_URL N [--limit L] [--max-tokens T] [--key K]``.

Prints one JSON line when it holds its first lease (``{"ready": client_id}``), waits for a line
on stdin (``go``) so that all processes start together, sends ``N`` completions through
``client.map`` and prints ``{"ok": n, "failed": n, "seconds": s, "limit": l}``. ``REDIS_URL``
``-`` runs without a shared budget (the uncoordinated comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

import dsclient


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("redis_url")
    parser.add_argument("n", type=int)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--key", default="dsclient")
    args = parser.parse_args(argv)
    shared = None if args.redis_url == "-" else args.redis_url
    async with dsclient.AsyncClient(
        args.url, shared=shared, shared_key=args.key, limit=args.limit, timeout=600
    ) as client:
        ident = client._shared.client_id if client._shared is not None else "local"
        print(json.dumps({"ready": ident}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started = time.perf_counter()
        prompts = [f"shared budget test {i} " + "word " * (i % 7) for i in range(args.n)]
        results = await client.map(
            prompts, max_tokens=args.max_tokens, ignore_eos=True, progress=False
        )
        seconds = time.perf_counter() - started
        print(
            json.dumps(
                {
                    "ok": len(results.ok),
                    "failed": len(results.failures),
                    "errors": sorted({type(f.error).__name__ for f in results.failures})
                    if results.failures
                    else [],
                    "seconds": seconds,
                    "limit": client.limit,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    asyncio.run(main(sys.argv[1:]))
