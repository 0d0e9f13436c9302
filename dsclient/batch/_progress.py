"""A progress bar for batches: done, failed, in flight and throughput, on a tqdm bar.

    bar = open_progress(None, total=1000)    # None: on in a terminal or a notebook
    bar.advance(ok=True, in_flight=7, tokens=32)
    bar.close()

``tqdm.auto`` draws a widget in notebooks and text in terminals; without ``ipywidgets`` in a
notebook it falls back to the text bar (which Jupyter shows as it updates).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["NullProgress", "Progress", "ProgressBar", "in_notebook", "open_progress", "wanted"]

_POSTFIX_EVERY_S = 0.25  # formatting the postfix costs more than the rest of an update


def in_notebook() -> bool:
    """True inside a Jupyter (IPython kernel) session."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except AttributeError:  # pragma: no cover - a module named IPython that is not IPython
        return False
    return shell is not None and getattr(shell, "kernel", None) is not None


def wanted(setting: bool | Mapping[str, Any] | None) -> bool:
    """Whether to draw: ``None`` means a terminal on stderr or a notebook; a mapping means yes."""
    if setting is None:
        isatty = getattr(sys.stderr, "isatty", None)
        return bool(isatty is not None and isatty()) or in_notebook()
    if isinstance(setting, Mapping):
        return True
    if isinstance(setting, bool):
        return setting
    raise TypeError(
        f"progress must be None (auto), True, False or a dict of tqdm options, got {setting!r}"
    )


class NullProgress:
    """The bar when progress is off: every method does nothing."""

    def advance(self, *, ok: bool, in_flight: int, tokens: int = 0, resumed: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


class ProgressBar:
    """A tqdm bar whose postfix shows failed, in flight, resumed and tokens per second."""

    def __init__(
        self,
        bar: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bar = bar
        self._clock = clock
        self._start = clock()
        self._next_postfix = self._start
        self.done = 0
        self.failed = 0
        self.resumed = 0
        self.tokens = 0

    def advance(self, *, ok: bool, in_flight: int, tokens: int = 0, resumed: bool = False) -> None:
        """One more item finished (``resumed``: read back from the output file)."""
        self.done += 1
        if not ok:
            self.failed += 1
        if resumed:
            self.resumed += 1
        self.tokens += tokens
        now = self._clock()
        if now >= self._next_postfix:
            self._next_postfix = now + _POSTFIX_EVERY_S
            self._set_postfix(in_flight, now)
        self._bar.update(1)

    def _set_postfix(self, in_flight: int, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        parts = [f"failed={self.failed}", f"in_flight={in_flight}"]
        if self.resumed:
            parts.append(f"resumed={self.resumed}")
        parts.append(f"tok/s={self.tokens / elapsed:.0f}")
        self._bar.set_postfix_str(", ".join(parts), refresh=False)

    def close(self) -> None:
        self._set_postfix(0, self._clock())
        self._bar.close()


Progress = NullProgress | ProgressBar


def open_progress(
    setting: bool | Mapping[str, Any] | None, *, total: int | None, desc: str = "map"
) -> Progress:
    """A :class:`ProgressBar` if :func:`wanted`, else a :class:`NullProgress`.

    A mapping is passed to tqdm as options (``{"file": sys.stdout, "desc": "eval"}``).
    """
    if not wanted(setting):
        return NullProgress()
    options: dict[str, Any] = {"total": total, "desc": desc, "unit": "req", "smoothing": 0.1}
    if isinstance(setting, Mapping):
        options.update(setting)
    return ProgressBar(_make_tqdm(options))


def _make_tqdm(options: dict[str, Any]) -> Any:
    from tqdm.auto import tqdm

    try:
        return tqdm(**options)
    except ImportError:  # the notebook bar needs ipywidgets; the text bar works there too
        from tqdm.std import tqdm as text_tqdm

        options.setdefault("file", sys.stderr)
        return text_tqdm(**options)
