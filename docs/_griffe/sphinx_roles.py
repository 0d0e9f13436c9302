"""Griffe extension for the docs build: turn the docstrings' reST into Markdown.

dsclient's docstrings are Google style with a little reST: cross-references
(``:func:`launch```, ``:class:`~dsclient.client._retry.Retry```), simple tables (``====  ====``
borders) and doctest lines.
mkdocstrings renders Markdown, where those show as ``:func:`` before code, a run of ``=`` signs
and a paragraph. Before mkdocstrings parses a docstring, this rewrites:

- each mention of a docs page (````docs/routing.md````) into a link to that page, when the page
  exists;
- each role into an optional autorefs link, resolved in the object's scope: a link when the
  target is rendered, plain code otherwise (private helpers), so it never fails ``--strict``;
- each simple table into a Markdown table (the first row is the header when a border follows it);
- each run of ``>>>`` lines and their output into a ``pycon`` code block;
- each indented example (a Markdown indented block, or a reST literal block after ``::``) into a
  fenced ``python`` block, so it is highlighted and gets a copy button; the ``::`` becomes ``:``.
  A block right under a Google section header (``Parameters:``, ``Returns:``, ...) or inside
  one is the section's content and stays as it is.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj):`([~!]?)([\w.]+)(?:\(\))?`")
_BORDER = re.compile(r"^=+(?: +=+)+ *$")
_DOCS = Path(__file__).resolve().parents[1]
_PAGE = re.compile(r"``docs/([\w-]+)\.md(#[\w-]+)?``")
_SECTION = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")  # a Google section header: "Parameters:"


def _target(obj: griffe.Object, name: str) -> str:
    head, _, rest = name.partition(".")
    try:
        path = obj.resolve(head)
    except Exception:  # unresolvable (a builtin, a typo): leave the name as written
        return name
    return f"{path}.{rest}" if rest else path


def _roles(obj: griffe.Object, text: str) -> str:
    def link(match: re.Match[str]) -> str:
        prefix, name = match.groups()
        title = name.rsplit(".", 1)[-1] if prefix == "~" else name
        return f'<autoref identifier="{_target(obj, name)}" optional>`{title}`</autoref>'

    return _ROLE.sub(link, text)


def _pages(text: str) -> str:
    def link(match: re.Match[str]) -> str:
        page, anchor = match[1], match[2] or ""
        if not (_DOCS / f"{page}.md").exists():  # a page still to be written: no broken link
            return match[0]
        return f"[{page.replace('-', ' ')}]({page}.md{anchor})"

    return _PAGE.sub(link, text)


def _table(lines: list[str]) -> list[str]:
    """A reST simple table (border lines included) as Markdown table lines."""
    starts = [m.start() for m in re.finditer(r"=+", lines[0])]
    borders = [i for i, line in enumerate(lines) if _BORDER.match(line)]
    rows: list[list[str]] = []
    header = 0
    for i, line in enumerate(lines):
        if i in borders:
            if 0 < i < len(lines) - 1 and rows:
                header = len(rows)
            continue
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        if rows and not cells[0]:  # a continuation line: its text joins the row above
            rows[-1] = [f"{old} {new}".strip() for old, new in zip(rows[-1], cells, strict=True)]
        else:
            rows.append(cells)
    head, body = (rows[:header], rows[header:]) if header == 1 else ([[""] * len(starts)], rows)

    def row(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return ["", row(head[0]), "|" + "---|" * len(starts), *(row(r) for r in body), ""]


def _blocks(text: str) -> str:
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _BORDER.match(line):
            borders = [j for j in range(i, len(lines)) if _BORDER.match(lines[j])]
            # A table ends at its second border, or at its third when the second closes the header.
            if len(borders) >= 2:
                end = borders[1]
                if len(borders) >= 3 and end == i + 2:
                    end = borders[2]
                out.extend(_table(lines[i : end + 1]))
                i = end + 1
                continue
        if line.startswith("    ") and i > 0 and not lines[i - 1].strip():
            head = next((x for x in reversed(out) if x.strip()), "")
            if head and not head.startswith(" ") and not _SECTION.match(head):
                j = i
                while j < len(lines) and (not lines[j].strip() or lines[j].startswith("    ")):
                    j += 1
                while j > i and not lines[j - 1].strip():
                    j -= 1
                if head.endswith("::"):
                    out[len(out) - 1 - out[::-1].index(head)] = head[:-1]
                lang = "pycon" if lines[i].lstrip().startswith(">>> ") else "python"
                out.extend([f"```{lang}", *(x[4:] for x in lines[i:j]), "```"])
                i = j
                continue
        if line.startswith(">>> "):
            j = i
            while j < len(lines) and lines[j].strip():
                j += 1
            out.extend(["```pycon", *lines[i:j], "```"])
            i = j
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrite the reST bits of every docstring in the package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()
        stack: list[griffe.Object] = [pkg]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None:
                obj.docstring.value = _blocks(_pages(_roles(obj, obj.docstring.value)))
            stack.extend(m for m in obj.members.values() if not m.is_alias)
