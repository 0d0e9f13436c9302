"""The order a batch's items start in: shared prefixes together, longest first, none starved.

Only the client sees a batch before the server does. A server (or a router in front of several)
sees arrivals one at a time: a batch of 20 system prompts x 500 questions sent in input order
makes it evict and recompute the same prefixes over and over, and a batch with a few long items
in random places ends with those few running alone while the other slots stand empty. The
batch runner (:mod:`dsclient.batch._batch`) reads a bounded window ahead of what has started
and asks a :class:`Lineup` which item goes next. Pure: no I/O, no clock.

    lineup = Lineup()
    lineup.add("a", ItemShape(blocks=("h1", "h2"), cost=300))
    lineup.add("b", ItemShape(blocks=(), cost=40))
    lineup.pop()    # "a": the longest

The window is ordered a whole round at a time: when the items of the last round have all
started, the items read since (the next round, up to the window's size) are put in order by
:func:`arrange`, and handed out in that order. Within a round:

1. **Prefix.** Items that share leading blocks (chained hashes, as the router hashes them:
   :func:`~dsclient.governor._routing.prefix_blocks`) start one after the other, those sharing
   the most first: a depth-first walk of the tree of their blocks. A group is started and
   finished while its prefix is still in the server's cache (and with several servers the
   router's prefix affinity sends it where the first of the group went). SGLang's scheduler
   calls this longest-prefix-match; done here, it sees the whole window.
2. **Longest first.** At each branch, the branch holding the longest item goes first, and the
   longest item first among those that share no more (longest-processing-time-first: long
   items start early and short ones fill the gaps at the end, instead of a long one starting
   last and running alone). Costs are predicted tokens, prompt plus ``max_tokens``
   (:func:`predicted_tokens`), compared by size class: powers of two (:func:`size_class`).
   Items within a class keep the order they were read in: the prediction is a byte estimate,
   and reordering 80 against 90 tokens gains nothing, so a batch without lengths to tell
   apart starts exactly as read.
3. **Continuity.** A round starts with the group the last one ended with, when it has items
   in the new round: its prefix is the one the server holds now.

Rounds are what keeps the order fair: an item waits at most for the rest of the round under
way and its own round, two windows of starts, however many longer or better-grouped items
arrive after it. (A window that slides one item at a time with an age limit does not: in a
full window the average item waits a whole window, so the age limit takes over and the order
decays into input order.) Items that cost the server nothing (read back from the output file on
resume, or invalid) skip the line: their outcomes are ready, and holding them back would only
delay the progress bar and ``on_error="raise"``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from ..governor._routing import RoutingPolicy, prefix_blocks, prefix_text
from ._caller import TokenSizer

__all__ = [
    "DEPTH",
    "ORDERS",
    "WINDOW",
    "ItemShape",
    "Lineup",
    "Order",
    "arrange",
    "predicted_tokens",
    "prefix_of",
    "size_class",
]

Order = Literal["shape", "input"]
#: ``"shape"`` (default): prefix groups, longest first, within the window. ``"input"``: as read.
ORDERS: tuple[Order, ...] = ("shape", "input")

#: Items read ahead of those started, when the order is ``"shape"``: a round. The window is what
#: the order can see: 20 prefixes in a shuffled batch need a few dozen items of each in a round
#: to form groups worth the name, and a GPU server's limit (a few hundred) is taken by the first
#: of a round. A thousand items of a few KB each is a few MB, whatever the batch's length.
WINDOW = 1024

#: Leading blocks an item is grouped by (``DEPTH x block_chars`` characters, 4 KiB by
#: default). Items that share that much are worth starting together; telling apart prefixes that
#: only differ beyond it would cost every item more hashing and a deeper tree for little.
DEPTH = 16

#: The router's block size, so that a group here is a group for the router's prefix affinity.
BLOCK_CHARS = RoutingPolicy().block_chars

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ItemShape:
    """What the order knows of one item.

    ``ItemShape(blocks=prefix_of(prompt), cost=predicted_tokens(prompt, 64, counter))``

    Parameters:
        blocks: chained hashes of the item's leading blocks (:func:`prefix_of`); ``()`` when
            it has no whole block (it shares nothing worth grouping).
        cost: predicted tokens (prompt + ``max_tokens``); the order starts the largest first,
            by size class (:func:`size_class`).
        free: the item costs the server nothing (resumed from the file, or invalid): start it
            at once.
    """

    blocks: tuple[Hashable, ...] = ()
    cost: int = 0
    free: bool = False


def prefix_of(
    prompt: str | Iterable[Mapping[str, Any]],
    *,
    block_chars: int = BLOCK_CHARS,
    depth: int = DEPTH,
) -> tuple[str, ...]:
    """The chained hashes of ``prompt``'s first ``depth`` blocks, as the router hashes them.

    ``prefix_of("You are ..." * 100)[:2]`` equals ``prefix_of("You are ..." * 90)[:2]``.
    A chat's text is its messages' roles and contents in order, so a shared system prompt and
    shared few-shot messages make a shared prefix.
    """
    return prefix_blocks(prefix_text(prompt)[: block_chars * depth], block_chars)


def predicted_tokens(
    prompt: str | Iterable[Mapping[str, Any]], max_tokens: int, counter: TokenSizer
) -> int:
    """An item's predicted tokens: its prompt's plus ``max_tokens``.

    ``predicted_tokens("x" * 400, 64, TokenCounter())`` is ``100 + 64``.

    The prompt is sized from its bytes (``counter.byte_estimate``: ``upper_bound /
    BYTES_PER_TOKEN``, the token counter's own last-resort estimate), not by the tokenizer: the
    order needs ranks, not exact counts, and the client itself never runs the tokenizer on a
    prompt whose bytes already fit. A message with non-text parts (no byte bound) is counted.
    """
    return counter.byte_estimate(prompt) + max_tokens


def size_class(cost: int) -> int:
    """The class an item's predicted tokens rank it in: ``floor(log2(cost)) + 1``.

    ``size_class(80) == size_class(127) == 7``; ``size_class(544) == 10``. Longest first
    compares classes, not tokens (rule 2 of the module).
    """
    return max(0, cost).bit_length()


class _Node:
    """One block of the tree a round is arranged on: its children, the items ending there,
    and the longest item below it (its size class, with the first read, for ties)."""

    __slots__ = ("best", "children", "items")

    def __init__(self) -> None:
        self.children: dict[Hashable, _Node] = {}
        self.items: list[int] = []
        self.best = (0, 0)  # (-size class, index) of the longest item below: sorts first


def arrange(shapes: Sequence[ItemShape], after: tuple[Hashable, ...] = ()) -> list[int]:
    """The order to start ``shapes`` in, as their indexes (rules 1-3 of the module).

    ``arrange([shape_a1, shape_b, shape_a2])`` is ``[0, 2, 1]`` when ``a1`` is the longest
    and ``a1``, ``a2`` share a prefix that ``b`` does not.

    Parameters:
        shapes: the round's items (``free`` is not looked at: the :class:`Lineup` keeps those
            apart).
        after: the blocks of the item started last: its group goes first (rule 3).
    """
    if not shapes:
        return []
    root = _Node()
    for index, shape in enumerate(shapes):
        node = root
        for block in shape.blocks:
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node()
            node = child
        node.items.append(index)
    _rank(root, shapes)
    order: list[int] = []
    preferred = set(after)
    stack: list[_Node | int] = [root]
    while stack:
        top = stack.pop()
        if isinstance(top, int):
            order.append(top)
            continue
        # Items ending here and the branches below, longest first; pushed in reverse so the
        # first comes off the stack first. A branch on the last item's path goes before all.
        things: list[tuple[tuple[int, int, int], _Node | int]] = [
            ((1, -size_class(shapes[i].cost), i), i) for i in top.items
        ]
        things += [
            ((0 if block in preferred else 1, *child.best), child)
            for block, child in top.children.items()
        ]
        things.sort(key=lambda t: t[0])
        stack.extend(thing for _, thing in reversed(things))
    return order


def _rank(root: _Node, shapes: Sequence[ItemShape]) -> None:
    """Set each node's ``best``, children before parents (iteratively: no recursion limit)."""
    walk: list[_Node] = [root]
    seen: list[_Node] = []
    while walk:
        node = walk.pop()
        seen.append(node)
        walk.extend(node.children.values())
    for node in reversed(seen):
        keys = [(-size_class(shapes[i].cost), i) for i in node.items]
        keys += [child.best for child in node.children.values()]
        node.best = min(keys)


class Lineup(Generic[T]):
    """A batch's window: items added as they are read, handed out round by round.

    ``lineup.add(item, ItemShape(blocks=..., cost=...))`` as items are read; ``lineup.pop()``
    when a worker is free for the next one. ``len(lineup)`` counts every item not yet popped,
    so a reader that keeps it at ``window`` makes rounds of ``window`` items.
    """

    def __init__(self) -> None:
        self._round: deque[tuple[T, int]] = deque()  # this round, in order, with costs
        self._next: list[tuple[T, ItemShape]] = []  # read since the round was arranged
        self._free: deque[T] = deque()
        self._last: tuple[Hashable, ...] = ()

    def __len__(self) -> int:
        return len(self._round) + len(self._next) + len(self._free)

    def add(self, value: T, shape: ItemShape) -> None:
        """Put ``value`` in the window (in the next round; at once when ``shape.free``)."""
        if shape.free:
            self._free.append(value)
        else:
            self._next.append((value, shape))

    def pop(self, skip: Callable[[int], bool] | None = None) -> T:
        """The item to start next; ``IndexError`` when the window is empty.

        With ``skip``, the first item of the round whose cost ``skip`` does not refuse, when
        the round has one (else the next as usual): the batch runner skips long items while the
        long ones it started wait for a slot, so that short ones fill the server meanwhile.
        """
        if self._free:
            return self._free.popleft()
        round_ = self._round
        if not round_:
            if not self._next:
                raise IndexError("pop from an empty Lineup")
            values = [value for value, _ in self._next]
            shapes = [shape for _, shape in self._next]
            self._next = []
            order = arrange(shapes, self._last)
            round_.extend((values[i], shapes[i].cost) for i in order)
            self._last = shapes[order[-1]].blocks
        if skip is not None and skip(round_[0][1]):
            for place, (value, cost) in enumerate(round_):
                if not skip(cost):
                    del round_[place]
                    return value
        return round_.popleft()[0]
