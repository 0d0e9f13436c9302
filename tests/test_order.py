"""The batch's start order (dsclient/batch/_order.py): pure, on item descriptions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dsclient.batch._order import (
    BLOCK_CHARS,
    DEPTH,
    ItemShape,
    Lineup,
    arrange,
    predicted_tokens,
    prefix_of,
    size_class,
)
from dsclient.client._tokens import TokenCounter
from dsclient.governor._routing import prefix_blocks, prefix_text


def shape(group: str | None, cost: int, depth: int = 3) -> ItemShape:
    """An item under prefix ``group`` (``depth`` shared blocks), or with none."""
    blocks = tuple(f"{group}/{d}" for d in range(depth)) if group is not None else ()
    return ItemShape(blocks=blocks, cost=cost)


def drain(lineup: Lineup) -> list:
    out = []
    while len(lineup):
        out.append(lineup.pop())
    return out


def runs(groups: list) -> int:
    """How many runs of equal neighbours: 1 per prefix when each is started in one go."""
    return sum(1 for i, g in enumerate(groups) if i == 0 or g != groups[i - 1])


def windowed(shapes: list[ItemShape], window: int) -> list[int]:
    """The order a batch runner with ``window`` would start ``shapes`` in (their indexes)."""
    lineup: Lineup[int] = Lineup()
    order: list[int] = []
    feed = iter(enumerate(shapes))
    for index, s in feed:
        lineup.add(index, s)
        if len(lineup) == window:
            break
    for index, s in feed:
        order.append(lineup.pop())
        lineup.add(index, s)
    order += drain(lineup)
    return order


# -- longest first -------------------------------------------------------------------------------
def test_without_prefixes_the_longest_goes_first_ties_in_arrival_order():
    lineup: Lineup[str] = Lineup()
    for name, cost in [("a", 10), ("b", 50), ("c", 30), ("d", 50), ("e", 10)]:
        lineup.add(name, shape(None, cost))
    assert drain(lineup) == ["b", "d", "c", "a", "e"]


def test_mixed_lengths_start_the_long_ones_first_within_the_window():
    rng = random.Random(7)
    costs = [560 if rng.random() < 0.1 else 80 for _ in range(200)]
    order = windowed([shape(None, c) for c in costs], window=200)
    longs = sum(1 for c in costs if c == 560)
    assert {costs[i] for i in order[:longs]} == {560}


def test_size_classes_are_powers_of_two():
    costs = (0, 1, 2, 3, 64, 80, 127, 128, 544)
    assert [size_class(c) for c in costs] == [0, 1, 2, 2, 7, 7, 7, 8, 10]


def test_lengths_within_a_size_class_keep_the_order_they_were_read_in():
    lineup: Lineup[str] = Lineup()
    for name, cost in [("a", 80), ("b", 120), ("c", 100), ("d", 300), ("e", 64)]:
        lineup.add(name, shape(None, cost))
    assert drain(lineup) == ["d", "a", "b", "c", "e"]


def test_a_batch_with_neither_shape_starts_exactly_as_read():
    # Unique prompts of 15-25 tokens, 64 out each (the batch-shape benchmark's "plain"):
    # nothing to gain, so nothing moves, whatever the window.
    rng = random.Random(5)
    shapes = [shape(None, 64 + rng.randrange(15, 26)) for _ in range(500)]
    for window in (16, 128, 1024):
        assert windowed(shapes, window) == list(range(500))


def test_pop_can_skip_long_items_for_the_next_short_one_of_the_round():
    lineup: Lineup[str] = Lineup()
    for name, cost in [("s1", 40), ("l1", 600), ("s2", 50), ("l2", 700)]:
        lineup.add(name, shape(None, cost))

    def is_long(cost: int) -> bool:
        return cost > 512

    assert lineup.pop(is_long) == "s1"  # the round is l1, l2, s1, s2: the first short
    assert lineup.pop() == "l1"
    assert lineup.pop(is_long) == "s2"
    assert lineup.pop(is_long) == "l2"  # no short left: the next as usual
    assert len(lineup) == 0


# -- prefixes ------------------------------------------------------------------------------------
def test_items_that_share_a_prefix_start_together_longest_first():
    lineup: Lineup[tuple[str, int]] = Lineup()
    items = [("A", 10), ("B", 90), ("A", 40), ("C", 5), ("B", 20), ("A", 70), ("C", 60)]
    for g, cost in items:
        lineup.add((g, cost), shape(g, cost))
    # B holds the longest item, so B first; then the longest of what is left (A's 70), ...
    assert drain(lineup) == [
        ("B", 90),
        ("B", 20),
        ("A", 70),
        ("A", 40),
        ("A", 10),
        ("C", 60),
        ("C", 5),
    ]


def test_the_deepest_shared_prefix_goes_next():
    # Two system prompts that begin alike (one block) and then differ: after an item of the
    # first, the others of the first go next, even a shorter one.
    lineup: Lineup[str] = Lineup()
    lineup.add("x1", ItemShape(blocks=("s", "x"), cost=100))
    lineup.add("y1", ItemShape(blocks=("s", "y"), cost=90))
    lineup.add("x2", ItemShape(blocks=("s", "x"), cost=10))
    lineup.add("z", ItemShape(blocks=("t",), cost=95))
    lineup.add("y2", ItemShape(blocks=("s", "y"), cost=80))
    # x1 (longest), x2 (same prefix), then y1 and y2 (share "s"), then z.
    assert drain(lineup) == ["x1", "x2", "y1", "y2", "z"]


def test_a_shuffled_prefix_heavy_batch_starts_each_prefix_in_one_go():
    rng = random.Random(3)
    batch = [(f"p{p}", rng.randrange(50, 90)) for p in range(20) for _ in range(30)]
    rng.shuffle(batch)
    shapes = [shape(g, cost) for g, cost in batch]
    groups = [batch[i][0] for i in windowed(shapes, window=1024)]
    assert runs(groups) == 20
    # A window smaller than the batch still groups most of it; input order groups nothing.
    # Rounds of 128: each prefix at most once a round (5 rounds), against 568 runs as read.
    small = [batch[i][0] for i in windowed(shapes, window=128)]
    assert runs([g for g, _ in batch]) == 568
    assert runs(small) <= 20 * 5


# -- free items and patience ---------------------------------------------------------------------
def test_free_items_go_at_once_and_leave_the_current_group_alone():
    lineup: Lineup[str] = Lineup()
    lineup.add("a1", shape("A", 50))
    lineup.add("b1", shape("B", 40))
    lineup.add("a2", shape("A", 10))
    assert lineup.pop() == "a1"
    lineup.add("resumed", ItemShape(free=True))
    assert lineup.pop() == "resumed"
    assert drain(lineup) == ["a2", "b1"]


def test_no_item_waits_more_than_two_windows():
    # A short item among a stream of long ones of other prefixes would wait forever under a
    # longest-first that slides over the input; rounds bound the wait.
    window = 16
    rng = random.Random(1)
    shapes = [shape(None, 1)] + [
        shape(f"g{rng.randrange(5)}", rng.randrange(100, 1000)) for _ in range(2000)
    ]
    order = windowed(shapes, window)
    assert sorted(order) == list(range(len(shapes)))
    started = {index: position for position, index in enumerate(order)}
    read = {index: max(0, index - window) for index in range(len(shapes))}  # pops before it
    assert max(started[i] - read[i] for i in started) < 2 * window
    assert started[0] < 2 * window


def test_a_round_starts_with_the_group_the_last_one_ended_with():
    lineup: Lineup[str] = Lineup()
    lineup.add("a", shape("A", 50))
    lineup.add("b", shape("B", 10))
    assert lineup.pop() == "a"
    lineup.add("c", shape("C", 99))
    lineup.add("b2", shape("B", 5))
    assert lineup.pop() == "b"  # the first round's end
    # The next round: B's prefix is the one the server holds now, so b2 before c (longer).
    assert drain(lineup) == ["b2", "c"]


def test_arrange_prefers_the_deepest_share_with_the_last_item():
    shapes = [
        ItemShape(blocks=("s",), cost=100),
        ItemShape(blocks=("s", "y"), cost=10),
        ItemShape(blocks=("s", "x"), cost=20),
        ItemShape(blocks=("t",), cost=500),
    ]
    # After an item under s/y: the rest of s/y, then the rest of s (longest first), then t.
    assert arrange(shapes, after=("s", "y", "q")) == [1, 0, 2, 3]
    assert arrange(shapes) == [3, 0, 2, 1]
    assert arrange([]) == []


# -- bookkeeping ---------------------------------------------------------------------------------
def test_every_item_comes_out_exactly_once():
    rng = random.Random(11)
    lineup: Lineup[int] = Lineup()
    added: list[int] = []
    popped: list[int] = []
    for i in range(5000):
        free = rng.random() < 0.05
        group = rng.choice([None, "a", "b", "c", "d"])
        lineup.add(i, ItemShape(blocks=shape(group, 0).blocks, cost=rng.randrange(500), free=free))
        added.append(i)
        while len(lineup) > 40 or (len(lineup) and rng.random() < 0.3):
            popped.append(lineup.pop())
    popped += drain(lineup)
    assert Counter(popped) == Counter(added)
    with pytest.raises(IndexError):
        lineup.pop()


def test_a_window_of_1024_long_prompts_is_arranged_in_milliseconds():
    # The cost per item the order adds to map(): arrange() once per round of the window.
    import time

    rng = random.Random(2)
    shapes = [
        ItemShape(blocks=tuple(f"p{p}/{d}" for d in range(DEPTH)), cost=rng.randrange(2000))
        for p in (rng.randrange(40) for _ in range(1024))
    ]
    start = time.perf_counter()
    order = arrange(shapes)
    assert sorted(order) == list(range(1024))
    assert time.perf_counter() - start < 0.5  # ~10 ms here; generous for a loaded machine


# -- describing an item --------------------------------------------------------------------------
def test_prefix_of_is_the_routers_hash_of_the_first_blocks():
    system = "You are a careful assistant. " * 40  # ~1160 characters: 4 whole blocks
    prompt = system + "What is 2 + 2?"
    assert prefix_of(prompt) == prefix_blocks(prefix_text(prompt), BLOCK_CHARS)
    assert prefix_of(prompt)[:4] == prefix_of(system + "Name a colour.")[:4]
    assert prefix_of("short prompt") == ()  # no whole block: nothing to group by
    long = "x" * (BLOCK_CHARS * (DEPTH + 5))
    assert len(prefix_of(long)) == DEPTH


def test_chats_sharing_system_and_few_shot_messages_share_a_prefix():
    system = {"role": "system", "content": "Answer in French. " * 40}
    shot = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"}]
    a = prefix_of([system, *shot, {"role": "user", "content": "Good night"}])
    b = prefix_of([system, *shot, {"role": "user", "content": "Thank you very much"}])
    other = prefix_of([{"role": "system", "content": "Answer in German. " * 40}])
    assert len(a) >= 2 and a[:2] == b[:2]
    assert a[0] != other[0]


def test_predicted_tokens_are_the_prompts_bytes_over_four_plus_max_tokens():
    counter = TokenCounter()
    assert predicted_tokens("x" * 400, 64, counter) == 100 + 64
    assert predicted_tokens("é" * 10, 0, counter) == 5  # 20 UTF-8 bytes
    chat = [{"role": "user", "content": "y" * 400}]
    assert predicted_tokens(chat, 16, counter) > 100 + 16  # the template's tokens count too
