"""The docs site's hand-kept lists stay complete (the build itself is ``nox -s docs``)."""

import re
from pathlib import Path

import dsclient

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_api_reference_documents_every_public_name():
    documented = re.findall(r"^::: dsclient\.(\w+)\s*$", (DOCS / "api.md").read_text(), re.M)
    assert sorted(documented) == sorted(set(dsclient.__all__) - {"__version__"})


def test_every_page_is_in_the_nav():
    nav = re.findall(r"^\s*- [^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    assert sorted(nav) == sorted(pages)
