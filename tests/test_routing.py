"""The routing policy (dsclient.governor._routing): pure, with a fake clock and a seeded random source."""

from __future__ import annotations

import random

import pytest

from dsclient.governor._routing import (
    CircuitBreaker,
    NoServer,
    PrefixIndex,
    Route,
    Router,
    RouteRequest,
    RoutingPolicy,
    ServerState,
    Wait,
    prefix_blocks,
)

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"
TINY = frozenset({"tiny"})
SYSTEM = "You are a careful assistant. " * 40  # ~1160 characters: 4 blocks of 256


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def state(url: str, **kw: object) -> ServerState:
    base: dict[str, object] = dict(
        url=url, models=TINY, limit=8, in_flight=0, waiting=0, kv_usage=0.0, metrics_age=0.1
    )
    base.update(kw)
    return ServerState(**base)  # type: ignore[arg-type]


def router(seed: int = 0, **policy: object) -> tuple[Router, Clock]:
    clock = Clock()
    return Router(RoutingPolicy(**policy), clock=clock, rng=random.Random(seed)), clock  # type: ignore[arg-type]


def routed(decision: object) -> Route:
    assert isinstance(decision, Route), decision
    return decision


# --- model --------------------------------------------------------------------------------------


def test_never_a_server_that_does_not_serve_the_model():
    r, _ = router()
    servers = [
        state(A, models=frozenset({"big"}), in_flight=0),
        state(B, models=TINY, in_flight=7),
        state(C, models=frozenset(), in_flight=0),
    ]
    for seed in range(50):
        r._rng = random.Random(seed)
        assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == B


def test_no_server_for_the_model_is_not_a_wait():
    r, _ = router()
    decision = r.choose([state(A, models=frozenset({"big"}))], RouteRequest(model="tiny"))
    assert decision == NoServer(model="tiny", served=frozenset({"big"}))


def test_model_none_takes_any_server():
    r, _ = router()
    assert routed(r.choose([state(A, models=frozenset({"x"}))], RouteRequest())).url == A


# --- room and load ------------------------------------------------------------------------------


def test_all_full_waits_on_the_client():
    r, _ = router()
    servers = [state(A, in_flight=8), state(B, in_flight=4, limit=4)]
    assert r.choose(servers, RouteRequest(model="tiny")) == Wait(reason="full")


def test_never_behind_a_busy_server_while_another_is_idle():
    r, _ = router()
    for _ in range(20):  # A has the prefix cached, yet a queue; B is idle
        r.index(A).add(prefix_blocks(SYSTEM))
    busy = state(A, in_flight=2, waiting=1, kv_usage=0.1)  # its score alone would win
    idle = state(B)
    for seed in range(50):
        r._rng = random.Random(seed)
        req = RouteRequest(model="tiny", prefix=SYSTEM + f" question {seed}")
        assert routed(r.choose([busy, idle], req)).url == B


def test_least_loaded_wins_without_a_prefix():
    r, _ = router()
    servers = [state(A, in_flight=5, kv_usage=0.4), state(B, in_flight=1, kv_usage=0.1)]
    decision = routed(r.choose(servers, RouteRequest(model="tiny")))
    assert decision.url == B and decision.reason == "score"
    assert decision.scores[B] > decision.scores[A]


def test_ties_are_broken_by_the_random_source():
    r, _ = router(seed=1)
    servers = [state(A), state(B), state(C)]
    seen = {routed(r.choose(servers, RouteRequest(model="tiny"))).url for _ in range(60)}
    assert seen == {A, B, C}


def test_saturated_servers_come_after_unsaturated_ones():
    r, _ = router()
    r.index(A).add(prefix_blocks(SYSTEM))
    # A holds the prefix and has room, but its queue is at llm-d's threshold (5).
    servers = [state(A, in_flight=2, waiting=5), state(B, in_flight=3, waiting=1)]
    assert r.saturated(servers[0]) and not r.saturated(servers[1])
    assert routed(r.choose(servers, RouteRequest(model="tiny", prefix=SYSTEM))).url == B


def test_kv_usage_over_its_threshold_saturates():
    r, _ = router()
    assert r.saturated(state(A, kv_usage=0.8))
    assert not r.saturated(state(A, kv_usage=0.79))


def test_stale_metrics_count_as_saturated():
    r, _ = router()
    stale = state(A, metrics_age=2.5)  # otherwise the better server: empty
    fresh = state(B, in_flight=4, waiting=1, kv_usage=0.3)
    assert r.saturated(stale) and not r.saturated(fresh)
    assert routed(r.choose([stale, fresh], RouteRequest(model="tiny"))).url == B


def test_a_server_without_metrics_is_judged_by_the_clients_counts():
    r, _ = router()
    plain = state(A, waiting=None, kv_usage=None, metrics_age=None, in_flight=1, limit=4)
    assert not r.saturated(plain)
    busy = state(B, in_flight=6, kv_usage=0.7, waiting=2)
    assert routed(r.choose([plain, busy], RouteRequest(model="tiny"))).url == A


def test_all_saturated_still_routes_where_there_is_room():
    r, _ = router()
    servers = [state(A, waiting=9, in_flight=4), state(B, waiting=6, in_flight=4)]
    assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == B


# --- prefix affinity ----------------------------------------------------------------------------


def test_prefix_blocks_are_chained_and_drop_the_partial_tail():
    one = prefix_blocks("x" * 256 + "y" * 256 + "z" * 10, 256)
    two = prefix_blocks("x" * 256 + "w" * 256, 256)
    assert len(one) == 2 and one[0] == two[0] and one[1] != two[1]
    assert prefix_blocks("short", 256) == ()
    with pytest.raises(ValueError, match="block_chars"):
        prefix_blocks("x", 0)


def test_prefix_index_is_an_lru_of_leading_blocks():
    index = PrefixIndex(capacity=3)
    index.add(("a", "b", "c"))
    assert index.match(("a", "b", "x")) == 2
    assert index.match(("x", "a")) == 0
    index.add(("d",))  # evicts "a", the least recently used
    assert len(index) == 3 and index.match(("a", "b")) == 0


def test_requests_sharing_a_prefix_stick_to_one_server():
    r, _ = router(seed=3)
    servers = {A: 0, B: 0}
    first = None
    for i in range(40):
        states = [state(u, in_flight=n) for u, n in servers.items()]
        decision = routed(r.choose(states, RouteRequest(model="tiny", prefix=SYSTEM + str(i))))
        first = first or decision.url
        assert decision.url == first, f"request {i} left the server holding its prefix"
        if i:
            assert decision.prefix_match == 1.0
        servers[decision.url] = min(4, servers[decision.url] + 1)  # busier, but not queued


def test_different_prefixes_spread_over_servers():
    r, _ = router(seed=5)
    prefixes = [f"document {k}: " + chr(65 + k) * 600 for k in range(8)]
    load = {A: 0, B: 0}
    where: dict[int, str] = {}
    for k, text in enumerate(prefixes):
        states = [state(u, in_flight=n) for u, n in load.items()]
        url = routed(r.choose(states, RouteRequest(model="tiny", prefix=text))).url
        where[k] = url
        load[url] += 1
    assert set(where.values()) == {A, B}
    # Each prefix comes back to where it went, the load being equal.
    for k, text in enumerate(prefixes):
        states = [state(A, in_flight=4), state(B, in_flight=4)]
        assert routed(r.choose(states, RouteRequest(model="tiny", prefix=text))).url == where[k]


def test_token_block_hashes_are_used_as_given():
    r, _ = router()
    r.index(B).add((1, 2, 3))
    decision = routed(r.choose([state(A), state(B)], RouteRequest(model="tiny", blocks=(1, 2, 9))))
    assert decision.url == B and decision.prefix_match == pytest.approx(2 / 3)


def test_the_balance_escape_overrides_the_prefix():
    req = RouteRequest(model="tiny", prefix=SYSTEM)

    def decide(a_load: int, b_load: int, limit: int) -> Route:
        r, _ = router(balance_abs=64, balance_rel=1.5)
        r.index(A).add(prefix_blocks(SYSTEM))  # only A holds the prefix
        servers = [state(A, limit=limit, in_flight=a_load), state(B, limit=limit, in_flight=b_load)]
        return routed(r.choose(servers, req))

    # 100 vs 30: difference 70 > 64 and 100 > 1.5 x 30: plain load balancing.
    assert (decide(100, 30, 200).url, decide(100, 30, 200).reason) == (B, "balance")
    # 100 vs 40: difference 60 <= 64: the prefix keeps it on A.
    assert (decide(100, 40, 200).url, decide(100, 40, 200).reason) == (A, "prefix")
    # 300 vs 210: difference 90 > 64 but 300 < 1.5 x 210: still the prefix.
    assert (decide(300, 210, 400).url, decide(300, 210, 400).reason) == (A, "prefix")


def test_the_chosen_server_learns_the_prefix_even_when_balanced_there():
    r, _ = router()
    req = RouteRequest(model="tiny", prefix=SYSTEM)
    routed(r.choose([state(A, limit=200, in_flight=100), state(B, limit=200, in_flight=0)], req))
    assert r.index(B).match(prefix_blocks(SYSTEM)) == 4 and len(r.index(A)) == 0


# --- the circuit breaker ------------------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count():
    clock = Clock()
    b = CircuitBreaker(eject_after=3, clock=clock, rng=random.Random(0))
    b.record_failure("timeout")
    b.record_failure("server_error")
    b.record_success()
    b.record_failure("timeout")
    b.record_failure("timeout")
    assert b.state == "closed" and b.consecutive_failures == 2
    b.record_failure("server_error")
    assert b.state == "open" and not b.allows_requests


def test_a_refused_connection_opens_at_once():
    clock = Clock()
    b = CircuitBreaker(clock=clock, rng=random.Random(0))
    b.record_failure("connect")
    assert b.state == "open" and b.last_reason == "connection refused"


def test_half_open_after_a_jittered_backoff_then_closed_when_healthy():
    clock = Clock()
    b = CircuitBreaker(backoff_base=1.0, backoff_cap=30.0, clock=clock, rng=random.Random(0))
    b.record_failure("connect")
    at = b.probe_at
    assert at is not None and 100.5 <= at <= 101.0  # [d/2, d] with d = 1 s
    clock.now = at - 0.01
    assert b.state == "open" and not b.probe_due
    clock.now = at
    assert b.state == "half_open" and b.probe_due and not b.allows_requests
    b.record_probe(healthy=True)
    assert b.state == "closed" and b.allows_requests


def test_unhealthy_probes_back_off_longer_up_to_the_cap():
    clock = Clock()
    b = CircuitBreaker(backoff_base=1.0, backoff_cap=8.0, clock=clock, rng=random.Random(2))
    b.record_failure("connect")
    waits = []
    for _ in range(6):
        at = b.probe_at
        assert at is not None
        waits.append(at - clock.now)
        clock.now = at
        b.record_probe(healthy=False)
    ceilings = [1, 2, 4, 8, 8, 8]
    for wait, d in zip(waits, ceilings):
        assert d / 2 <= wait <= d
    # A probe that passes does not reset the backoff; a successful request does.
    clock.now = b.probe_at or 0.0
    b.record_probe(healthy=True)
    b.record_failure("connect")
    assert (b.probe_at or 0) - clock.now >= 4.0
    clock.now = b.probe_at or 0.0
    b.record_probe(healthy=True)
    b.record_success()
    b.record_failure("connect")
    assert (b.probe_at or 0) - clock.now <= 1.0


def test_jitter_spreads_probes():
    clock = Clock()
    ats = set()
    for seed in range(20):
        b = CircuitBreaker(backoff_base=4.0, clock=clock, rng=random.Random(seed))
        b.record_failure("connect")
        ats.add(round(b.probe_at or 0.0, 6))
    assert len(ats) == 20 and min(ats) >= 102.0 and max(ats) <= 104.0


def test_an_unhealthy_probe_opens_a_closed_breaker_and_a_healthy_one_keeps_it_closed():
    clock = Clock()
    b = CircuitBreaker(clock=clock, rng=random.Random(0))
    b.record_probe(healthy=True)
    assert b.state == "closed"
    b.record_probe(healthy=False)
    assert b.state == "open" and b.last_reason == "unhealthy probe"
    b.record_probe(healthy=True)  # too early: still open, the backoff stands
    assert b.state == "open"


def test_router_ejects_a_failing_server_and_readmits_it_after_a_healthy_probe():
    r, clock = router()
    servers = [state(A), state(B, in_flight=3)]
    r.record_failure(A, "connect")
    for _ in range(10):
        assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == B
    assert r.probes_due([A, B]) == []
    clock.now += 1.0
    assert r.probes_due([A, B]) == [A]
    assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == B  # half-open: no requests
    r.record_probe(A, healthy=True)
    assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == A


def test_an_unhealthy_state_ejects_and_every_server_out_waits_for_the_first_probe():
    r, _ = router()
    servers = [state(A, healthy=False), state(B)]
    assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == B
    r.record_failure(B, "connect")
    decision = r.choose(servers, RouteRequest(model="tiny"))
    assert isinstance(decision, Wait) and decision.reason == "ejected"
    assert decision.probe_at == min(r.breaker(A).probe_at or 0, r.breaker(B).probe_at or 0)


def test_a_server_that_died_forgets_its_prefixes():
    r, _ = router()
    r.index(A).add(prefix_blocks(SYSTEM))
    r.record_failure(A, "connect")
    assert len(r.index(A)) == 0


def test_overloaded_answers_are_not_failures_by_construction():
    # FailureKind has no overload member: the governor handles 429/503, not the breaker.
    import typing

    from dsclient.governor._routing import FailureKind

    assert set(typing.get_args(FailureKind)) == {"connect", "timeout", "server_error"}


# --- validation ---------------------------------------------------------------------------------


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="kv_usage"):
        state(A, kv_usage=1.5)
    with pytest.raises(ValueError, match="in_flight"):
        state(A, in_flight=-1)
    with pytest.raises(ValueError, match="backoff_cap"):
        RoutingPolicy(backoff_base=10, backoff_cap=5)
    with pytest.raises(ValueError, match="eject_after"):
        RoutingPolicy(eject_after=0)
    with pytest.raises(ValueError, match="eject_after"):
        CircuitBreaker(eject_after=0)


# --- retries go elsewhere -----------------------------------------------------------------------


def test_a_retry_avoids_the_server_it_failed_on():
    r, _ = router()
    servers = [state(A), state(B, in_flight=6, kv_usage=0.6)]  # A is the better server
    assert routed(r.choose(servers, RouteRequest(model="tiny"))).url == A
    retry = RouteRequest(model="tiny", avoid=frozenset({A}))
    assert routed(r.choose(servers, retry)).url == B


def test_a_retry_waits_for_a_full_other_server_rather_than_going_back():
    r, _ = router()
    servers = [state(A), state(B, in_flight=8)]
    retry = RouteRequest(model="tiny", avoid=frozenset({A}))
    assert r.choose(servers, retry) == Wait(reason="full")


def test_a_retry_goes_back_when_no_other_server_is_in_rotation():
    r, _ = router()
    r.record_failure(B, "connect")
    servers = [state(A), state(B)]
    retry = RouteRequest(model="tiny", avoid=frozenset({A}))
    assert routed(r.choose(servers, retry)).url == A
    assert routed(r.choose([state(A)], retry)).url == A


def test_a_held_prefix_beats_a_shorter_queue_and_more_room():
    """The prefix rule (SGLang's cache_threshold, 0.5): scored as one term of four, the prefix
    lost to more room and a lighter KV cache; now a server holding the prefix takes it while it
    has room, no queue of its own beside an idle server, and is not saturated."""
    r, _ = router()
    r.index(A).add(prefix_blocks(SYSTEM))
    # B is idle; A is busier but has no queue of its own (a queue at A would send it to B).
    servers = [state(A, in_flight=3, waiting=0, kv_usage=0.5), state(B, in_flight=0, waiting=0)]
    decision = routed(r.choose(servers, RouteRequest(model="tiny", prefix=SYSTEM + "q?")))
    assert (decision.url, decision.reason) == (A, "prefix")
    # Under the threshold (a quarter of the blocks held) the load decides.
    r2, _ = router()
    r2.index(A).add(prefix_blocks(SYSTEM)[:1])
    decision = routed(r2.choose(servers, RouteRequest(model="tiny", prefix=SYSTEM)))
    assert decision.url == B and decision.reason == "score"
    with pytest.raises(ValueError, match="cache_threshold"):
        RoutingPolicy(cache_threshold=0)


def test_the_prefix_index_is_sized_to_the_servers_kv_cache():
    """An index larger than vLLM's cache claims prefixes vLLM has evicted: each server's index
    holds what its KV cache holds (4 characters a token, blocks of 256 characters)."""
    r, _ = router()
    r.index(A).add(f"h{i}" for i in range(100))
    r.size_index(A, kv_cache_tokens=1536)  # 96 vLLM blocks of 16 tokens
    assert r.index(A).capacity == 24 and len(r.index(A)) == 24
    assert r.index(A).match(["h99"]) == 1 and r.index(A).match(["h0"]) == 0  # oldest went
    fixed, _ = router(index_blocks=500)
    fixed.size_index(A, kv_cache_tokens=1536)
    assert fixed.index(A).capacity == 500  # a size the policy names stays
