"""The README's "Use" snippets run as written against the shared real vLLM server.

The README calls ``http://127.0.0.1:8000``, where ``dsclient serve`` listens when 8000 is free
(``tests/test_launcher.py`` checks that choice). The shared server may sit on another port, so
the snippets run with that URL swapped for the server's; nothing else in their text changes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsclient.launcher import DEFAULT_PORT

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = f"http://127.0.0.1:{DEFAULT_PORT}"


def use_snippets() -> list[str]:
    """The ```python blocks of the README's "## Use" section, in order."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Use\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, 'README.md has no "## Use" section'
    return re.findall(r"^```python\n(.*?)^```", section.group(1), flags=re.M | re.S)


def as_script(snippets: list[str], url: str) -> str:
    """One runnable script: a snippet with top-level ``await`` / ``async with`` goes into
    ``async def`` run by ``asyncio.run``, the way a notebook cell would run it; its imports stay
    at module level, where the later snippets use them too."""
    parts = ["import asyncio"]
    for n, code in enumerate(snippets):
        code = code.replace(README_URL, url)
        if re.search(r"^\s*(await |async (with|for) )", code, flags=re.M):
            lines = code.splitlines()
            parts += [ln for ln in lines if ln.startswith(("import ", "from "))]
            body = "\n".join(ln for ln in lines if not ln.startswith(("import ", "from ")))
            parts.append(f"async def snippet_{n}():\n{textwrap.indent(body, '    ')}")
            parts.append(f"asyncio.run(snippet_{n}())")
        else:
            parts.append(code)
    return "\n\n".join(parts) + "\n"


def test_the_snippets_are_found_and_call_the_default_port():
    snippets = use_snippets()
    assert len(snippets) == 2, snippets
    assert all(README_URL in s for s in snippets)
    assert "await client.generate(" in snippets[0] and "dsclient.Client(" in snippets[1]


def test_readme_use_snippets_run(vllm_server, tmp_path):
    script = tmp_path / "readme_use.py"
    script.write_text(as_script(use_snippets(), vllm_server.url), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
    assert "prompt_tokens=" in out.stdout  # print(result.text, result.usage, result.latency_s)
    # client.map(..., output="out.jsonl") wrote its two results where the snippet ran.
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(x["index"] for x in lines) == [0, 1] and all(x["ok"] for x in lines)
