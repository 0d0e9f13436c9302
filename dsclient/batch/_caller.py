"""What the batch runner needs of a client: the :class:`BatchClient`, :class:`BatchCaller` and
:class:`BatchPlanner` protocols.

    results = await run_map(client, prompts, caller=client._caller, planner=client._planner)

The runner sits below the client: ``AsyncClient.map()`` and ``imap()`` call it with the client
and the two objects it is composed of (its :class:`~dsclient.client._caller.Caller` and
:class:`~dsclient.client._planner.Planner`), so the runner must not import the client back. It
names what it uses of each instead, and any objects with these members can drive a batch
(``AsyncClient``, ``Caller`` and ``Planner`` have them; a test can pass fakes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, Literal, Protocol

from .._arguments import Prompt, UseDefault
from .._models import Result
from .._server_info import ServerInfo

__all__ = ["BatchCaller", "BatchClient", "BatchPlanner", "TokenSizer"]


class TokenSizer(Protocol):
    """Sizes a prompt without the tokenizer (``dsclient.client._tokens.TokenCounter`` does)."""

    def byte_estimate(self, prompt: str | Iterable[Mapping[str, Any]]) -> int:
        """The prompt's tokens from its bytes: enough to rank items by, not to fit them."""
        ...


class BatchClient(Protocol):
    """A client, as the batch runner uses it (``AsyncClient`` is one): its limit and discovery."""

    @property
    def limit(self) -> int:
        """The in-flight limit now: the runner keeps this many workers, plus a read-ahead."""
        ...

    def on_limit_raise(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` whenever the limit rises; returns the function that removes it."""
        ...

    async def discover(self) -> ServerInfo:
        """Discover the server(s) once, before the first item is read."""
        ...


class BatchCaller(Protocol):
    """Each item's call (the client's :class:`~dsclient.client._caller.Caller` is one)."""

    def long_in_flight(self) -> int:
        """Long-lane calls holding a slot now (the start order hands out long items by it)."""
        ...

    def timeout_of(self, timeout: float | UseDefault | None) -> float | None:
        """The timeout a call gets (checks it: ``ValueError`` for a bad one)."""
        ...

    async def request(
        self,
        kind: Literal["completion", "chat"],
        prompt: Prompt,
        max_tokens: int | None,
        urgency: int,
        group: str | None,
        timeout: float | UseDefault | None,
        sampling: dict[str, Any],
        *,
        index: int | None = None,
        batch: Hashable = False,
    ) -> Result:
        """One call, its arguments already checked; raises what ``generate()`` raises.
        ``batch``: the key of the batch it is an item of (the governor lets a batch's long
        items borrow beside its own short items, not beside another batch's)."""
        ...


class BatchPlanner(Protocol):
    """Sizes items (the client's :class:`~dsclient.client._planner.Planner` is one)."""

    def read_size(self, tokens: int) -> None:
        """A batch read an item of about ``tokens``: what is long is judged beside it too."""
        ...

    def is_long(self, tokens: int) -> bool:
        """Whether an item of about ``tokens`` (prompt + ``max_tokens``) takes the long lane."""
        ...

    @property
    def default_max_tokens(self) -> int:
        """``max_tokens`` for an item that gives none (to rank it by its predicted tokens)."""
        ...

    @property
    def tokens(self) -> TokenSizer:
        """The client's token counter, to rank items by size."""
        ...
