"""examples/batch.ipynb runs top to bottom against the shared real vLLM server."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.integration

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "batch.ipynb"


def test_batch_notebook_runs(vllm_server, monkeypatch, tmp_path):
    # The kernel inherits this process's environment: the notebook uses this server.
    monkeypatch.setenv("DSCLIENT_URL", vllm_server.url)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    html = [
        out["data"]["text/html"]
        for out in outputs
        if out.output_type == "execute_result" and "text/html" in out.get("data", {})
    ]
    # The batch shows as a summary table (41 items, one bad), not a wall of reprs.
    assert any("<table>" in h and "<td>41</td>" in h for h in html), html
    # The progress bar reached the end inside the cell (the loop runs on a background thread).
    streams = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    widgets = [
        out for out in outputs if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
    ]
    assert "41/41" in streams or widgets, streams[-500:]
