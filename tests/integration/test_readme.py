"""The README's "Use" snippets run as written, as scripts, twice, against the shared real vLLM.

The README calls ``http://127.0.0.1:8000``, where ``dsclient serve`` listens when 8000 is free
(``tests/test_launcher.py`` checks that choice). The shared server may sit on another port, so
the snippets run with that URL swapped for the server's; nothing else in their text changes.
Each runs twice in the same folder, as a user runs a script again: what it writes (``map()``'s
``output=``) must not make the second run fail (issue 45: it raised ``FileExistsError``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsclient.launcher import DEFAULT_PORT

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = f"http://127.0.0.1:{DEFAULT_PORT}"


def use_snippets() -> list[str]:
    """The ```python blocks of the README's "## Use" section, in order."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Use\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, 'README.md has no "## Use" section'
    return re.findall(r"^```python\n(.*?)^```", section.group(1), flags=re.M | re.S)


def all_snippets() -> list[str]:
    """Every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)


def test_the_snippets_are_found_and_call_the_default_port():
    snippets = use_snippets()
    assert len(snippets) == 2, snippets
    assert all(README_URL in s for s in snippets)
    assert "await client.generate(" in snippets[0] and "dsclient.Client(" in snippets[1]


@pytest.mark.parametrize("n", range(len(all_snippets())))
def test_every_readme_snippet_is_a_script(n):
    # Pasted into a .py file, a top-level `async with` was a SyntaxError (issue 45).
    compile(all_snippets()[n], f"README.md python block {n}", "exec")


@pytest.mark.integration
@pytest.mark.parametrize("n", range(len(all_snippets())))
def test_readme_snippet_runs_twice_as_a_script(vllm_server, tmp_path, n):
    script = tmp_path / f"readme_{n}.py"
    script.write_text(all_snippets()[n].replace(README_URL, vllm_server.url), encoding="utf-8")
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-3000:]}"
        runs.append(out.stdout)
    if "client.map(" in script.read_text():
        assert "prompt_tokens=" in runs[0]  # print(result.text, result.usage, result.latency_s)
        # map(..., output="out.jsonl", resume=True) wrote its two results once, not twice.
        lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert sorted(x["index"] for x in lines) == [0, 1] and all(x["ok"] for x in lines)
