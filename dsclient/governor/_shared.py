"""A shared in-flight budget in Redis: many client processes on one server hold one limit.

    async with dsclient.AsyncClient(url, shared="redis://10.0.0.5:6379/0") as client:
        ...                    # every process with the same server URL and key shares client.limit

**Leases.** The budget is a Redis sorted set of lease ids scored by their expiry. One Lua script
(:data:`SYNC_SCRIPT`) trims expired leases and dead clients, counts what the others hold and
grants this client its leases, all atomically and on Redis's own clock (``TIME`` inside the
script): hosts with skewed clocks would otherwise expire each other's leases early or late. A
lease lives :data:`LEASE_S` seconds and is renewed at every sync (every ``interval``, 0.2 s), so
a process killed with ``kill -9`` gives its share back within the lease time.

**No round trip per request.** A client holds a block of leases and its governor's limit is the
size of that block: a request takes a local slot as before, and Redis is asked only by the
background sync. Each sync publishes this client's demand (in flight + waiting), in flight and
whether the limit holds it back, and reads everyone's; the next block is this client's fair share
of the limit (:func:`fair_shares`: max-min fair, every live client at least one lease). A client
grows only into leases nobody holds, and never holds fewer leases than requests in flight, while
its governor admits only up to its share: when the limit falls, the leases over the share go back
as the requests holding them end, and the sum of everyone's in flight never passes the shared
limit for longer than a request that was already running when it fell. A client's first lease
waits for room (``async with`` waits for it), and once it holds one it keeps at least one (the
governor's limit cannot be 0), so N clients need a limit of at least N. The one gap: a client
whose leases Redis lost (a restart) and that finds no room holds none, yet its governor lets one
request through until the next sync.

**One closed loop.** One client is the leader (a key with the lease's TTL, taken by a client with
traffic): it runs the limit controller on the server's ``/metrics`` against the total in flight of
all clients and publishes the limit and the learned capacity; the others read them. When the
leader goes idle or dies, another busy client takes over, starting from the published limit.

**Tenants across processes.** Where calls carry a group (a tenant,
:mod:`dsclient.governor._fair`), each sync also runs :data:`FAIR_SCRIPT`: it adds what this
process charged each tenant since the last sync to counters in one Redis hash, marks the tenants
that wait and that are active here (marks live a lease, so a killed process's marks go, while
what it charged stays), and reads everyone's counters and marks back. Each process then orders
its own waiters by the shared counters, and holds back a tenant that is ahead of one waiting in
another process by more than the largest call's cost; held calls do not count in the demand it
publishes, so the other process's share of the limit grows instead.

**Redis away.** A failed sync switches the client to its local closed loop (its own controller,
from the share it held), logged once at WARNING (the URL without its password); it tries Redis
again every second and rejoins when it answers. No request waits on Redis and none is dropped:
the governor's limit only changes size.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import anyio

if TYPE_CHECKING:
    from ._control import LimitController
    from ._governor import Governor

__all__ = [
    "FAIR_SCRIPT",
    "LEASE_S",
    "SYNC_INTERVAL_S",
    "SYNC_SCRIPT",
    "Member",
    "Peer",
    "SharedBudget",
    "SharedState",
    "SyncResult",
    "fair_args",
    "fair_shares",
    "parse_fair",
    "parse_sync",
    "redact_url",
]

logger = logging.getLogger("dsclient")

#: Seconds a lease lives without renewal: what a killed client's share takes to come back.
LEASE_S: Final = 3.0
#: Seconds between two syncs with Redis (each renews every lease this client holds).
SYNC_INTERVAL_S: Final = 0.2
#: Seconds between two tries while Redis does not answer (the client runs its local loop).
RETRY_S: Final = 1.0
#: Seconds after the last sync of any client at which the budget's keys expire.
IDLE_S: Final = 60.0
#: Seconds a redis-py call may take before the sync counts as failed.
REDIS_TIMEOUT_S: Final = 1.0

Mode = Literal["shared", "local"]

#: KEYS: 1 leases (zset id:i -> expiry ms), 2 clients (zset id -> expiry ms), 3 state (hash id ->
#: "demand inflight held"), 4 limit, 5 leader, 6 capacity.
#: ARGV: 1 client id, 2 lease ms, 3 leases this client added last time, 4 target, 5 in flight,
#: 6 state string, 7 proposed limit, 8 capacity ("" unknown), 9 "1" to leave.
#: Returns {granted, limit, is_leader, capacity ("" unknown), id1, state1, id2, state2, ...}.
#: Every key expires a minute after the last sync of any client (:data:`IDLE_S`): a budget nobody
#: uses leaves nothing behind, and the next job starts from its own discovery, not from a limit
#: learned on yesterday's server.
SYNC_SCRIPT: Final = """
local IDLE_MS = {idle_ms}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local lease_ms = tonumber(ARGV[2])
local prev = tonumber(ARGV[3])
local target = tonumber(ARGV[4])
local inflight = tonumber(ARGV[5])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, c in ipairs(dead) do redis.call('HDEL', KEYS[3], c) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local mine = 0
for i = 0, prev - 1 do
  if redis.call('ZREM', KEYS[1], id .. ':' .. i) == 1 then mine = mine + 1 end
end
if ARGV[9] == '1' then
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
  if redis.call('GET', KEYS[5]) == id then redis.call('DEL', KEYS[5]) end
  return {0, 0, 0, ''}
end
redis.call('ZADD', KEYS[2], now + lease_ms, id)
redis.call('HSET', KEYS[3], id, ARGV[6])
local leader = redis.call('GET', KEYS[5])
local busy = tonumber(string.match(ARGV[6], '^%d+')) > 0
if (not leader) and busy then leader = id end
if leader == id then
  if busy then redis.call('SET', KEYS[5], id, 'PX', lease_ms) else
    redis.call('DEL', KEYS[5]); leader = false end
end
local limit = tonumber(redis.call('GET', KEYS[4]) or '0')
if leader == id or limit < 1 then
  limit = tonumber(ARGV[7])
  redis.call('SET', KEYS[4], limit)
  if ARGV[8] ~= '' then redis.call('SET', KEYS[6], ARGV[8]) end
end
local others = redis.call('ZCARD', KEYS[1])
local want = math.max(target, inflight, 1)
local grant = want
if want > mine then
  grant = math.max(mine, math.min(want, limit - others), inflight)
end
for i = 0, grant - 1 do redis.call('ZADD', KEYS[1], now + lease_ms, id .. ':' .. i) end
for _, k in ipairs({1, 2, 3, 4, 6}) do redis.call('PEXPIRE', KEYS[k], IDLE_MS) end
local out = {grant, limit, leader == id and 1 or 0, redis.call('GET', KEYS[6]) or ''}
local states = redis.call('HGETALL', KEYS[3])
for i = 1, #states do out[#out + 1] = states[i] end
return out
""".replace("{idle_ms}", str(int(IDLE_S * 1000)))


#: KEYS: 1 counters (hash tenant -> service over weight), 2 active marks, 3 waiting marks (hashes
#: "client\ntenant" -> expiry ms). ARGV: 1 client id, 2 lease ms, 3 n deltas, then n pairs
#: (tenant, delta), then the tenants active here (count, names), then those waiting here (count,
#: names). A tenant is its group's name; calls without a group are "\0". Returns
#: {counters (flat hash), active elsewhere (list), waiting elsewhere (list)}.
FAIR_SCRIPT: Final = """
local IDLE_MS = {idle_ms}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id = ARGV[1]
local lease_ms = tonumber(ARGV[2])
local i = 3
local n = tonumber(ARGV[i])
for k = 1, n do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i + 2 * k - 1], ARGV[i + 2 * k])
end
i = i + 2 * n + 1
local function mark(key)
  local count = tonumber(ARGV[i])
  for k = 1, count do
    redis.call('HSET', key, id .. '\\n' .. ARGV[i + k], now + lease_ms)
  end
  i = i + count + 1
end
local function elsewhere(key)
  local out, seen = {}, {}
  local marks = redis.call('HGETALL', key)
  for k = 1, #marks, 2 do
    local field, expiry = marks[k], tonumber(marks[k + 1])
    local cut = string.find(field, '\\n', 1, true)
    local client, tenant = string.sub(field, 1, cut - 1), string.sub(field, cut + 1)
    if expiry <= now then
      redis.call('HDEL', key, field)
    elseif client ~= id and not seen[tenant] then
      seen[tenant] = true
      out[#out + 1] = tenant
    end
  end
  return out
end
for _, key in ipairs({KEYS[2], KEYS[3]}) do
  local marks = redis.call('HKEYS', key)
  for _, field in ipairs(marks) do
    if string.sub(field, 1, #id + 1) == id .. '\\n' then redis.call('HDEL', key, field) end
  end
end
mark(KEYS[2])
mark(KEYS[3])
local active = elsewhere(KEYS[2])
local waiting = elsewhere(KEYS[3])
for k = 1, 3 do redis.call('PEXPIRE', KEYS[k], IDLE_MS) end
return {redis.call('HGETALL', KEYS[1]), active, waiting}
""".replace("{idle_ms}", str(int(IDLE_S * 1000)))
#: How a tenant of no group is written in Redis.
_NO_GROUP: Final = "\0"


def fair_args(
    client_id: str,
    lease_ms: int,
    deltas: Mapping[str | None, float],
    active: Sequence[str | None],
    waiting: Sequence[str | None],
) -> list[str | int | float]:
    """:data:`FAIR_SCRIPT`'s ARGV."""
    args: list[str | int | float] = [client_id, lease_ms, len(deltas)]
    for name, delta in deltas.items():
        args += [_NO_GROUP if name is None else name, repr(float(delta))]
    for names in (active, waiting):
        args.append(len(names))
        args += [_NO_GROUP if name is None else name for name in names]
    return args


def parse_fair(
    raw: Sequence[Any],
) -> tuple[dict[str | None, float], list[str | None], list[str | None]]:
    """:data:`FAIR_SCRIPT`'s answer: the counters, tenants active and waiting elsewhere."""

    def name(value: Any) -> str | None:
        text = _str(value)
        return None if text == _NO_GROUP else text

    flat = raw[0]
    counters = {name(flat[k]): float(_str(flat[k + 1])) for k in range(0, len(flat), 2)}
    return counters, [name(v) for v in raw[1]], [name(v) for v in raw[2]]


class _Revealable(Protocol):
    def reveal(self) -> str: ...


def redact_url(url: str) -> str:
    """The Redis URL without its user and password, for logs, reprs and errors.

    redact_url("redis://:s3cret@cache:6379/0")  ->  "redis://***@cache:6379/0"
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "<unparsable redis url>"
    auth = "***@" if (parts.username or parts.password) else ""
    return f"{parts.scheme}://{auth}{host}{port}{parts.path}"


def fair_shares(limit: int, demands: Sequence[int]) -> list[int]:
    """Max-min fair shares of ``limit`` among clients with these demands, each at least 1.

        fair_shares(12, [1, 10, 10])  ->  [1, 6, 5]   # the small demand is met, the rest split
        fair_shares(12, [0, 0, 0])    ->  [1, 1, 1]   # idle clients keep one lease each

    A client never gets more than its demand unless everyone's demand is met, and then the rest
    is not handed out (a client grows when its demand does). Remainders go to the earlier
    clients (the caller orders them, by id). Parameters: ``limit``, the shared limit;
    ``demands``, each client's in flight + waiting.
    """
    n = len(demands)
    if n == 0:
        return []
    extra_wanted = [max(1, d) - 1 for d in demands]
    left = max(0, limit - n)
    # Water-filling: the highest level L with sum(min(extra, L)) <= left.
    lo, hi = 0, max(extra_wanted)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(e, mid) for e in extra_wanted) <= left:
            lo = mid
        else:
            hi = mid - 1
    shares = [1 + min(e, lo) for e in extra_wanted]
    left -= sum(shares) - n
    # What the level left over goes to unmet demands, in the caller's order.
    for i in range(n):
        if left <= 0:
            break
        if extra_wanted[i] > lo:
            shares[i] += 1
            left -= 1
    return shares


@dataclass(frozen=True)
class Peer:
    """One live client as its last sync published it."""

    id: str
    demand: int
    in_flight: int
    held_back: bool


@dataclass(frozen=True)
class SyncResult:
    """What one sync returned: this client's block, the shared limit and everyone's state."""

    granted: int
    limit: int
    leader: bool
    capacity: int | None
    peers: tuple[Peer, ...]

    @property
    def total_in_flight(self) -> int:
        return sum(p.in_flight for p in self.peers)

    @property
    def held_back(self) -> bool:
        return any(p.held_back for p in self.peers)

    def target_for(self, client_id: str, demand: int, held: int | None = None) -> int:
        """This client's fair share of :attr:`limit` given everyone's published demand, its own
        replaced by ``demand`` (what it has now, not at the last sync).

        With ``held`` (the leases it holds) the share grows by at most an equal split of the
        limit per sync: the others' demands are a sync old, and processes that start together
        each saw the others idle (the first to sync took 13 of 16 leases and the others one
        each, until its requests ended, in the benchmark's first run).
        """
        peers = sorted(self.peers, key=lambda p: p.id)
        ids = [p.id for p in peers]
        demands = [p.demand for p in peers]
        if client_id in ids:
            demands[ids.index(client_id)] = demand
        else:
            ids.append(client_id)
            demands.append(demand)
        share = fair_shares(self.limit, demands)[ids.index(client_id)]
        if held is None:
            return share
        return min(share, held + max(1, -(-self.limit // len(ids))))


def _int(value: Any) -> int:
    if isinstance(value, bytes):
        value = value.decode()
    return int(value)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_sync(raw: Sequence[Any]) -> SyncResult:
    """Parse :data:`SYNC_SCRIPT`'s answer (a flat list; bytes or str) into a :class:`SyncResult`."""
    capacity = _str(raw[3])
    peers = []
    for i in range(4, len(raw) - 1, 2):
        fields = _str(raw[i + 1]).split()
        demand, in_flight, held = (int(f) for f in fields[:3])
        peers.append(Peer(_str(raw[i]), demand, in_flight, bool(held)))
    return SyncResult(
        granted=_int(raw[0]),
        limit=_int(raw[1]),
        leader=_int(raw[2]) == 1,
        capacity=int(capacity) if capacity else None,
        peers=tuple(peers),
    )


class SharedState:
    """Pure: whether this client runs on the shared budget or on its own loop, and when to sync.

        state = SharedState(clock=fake)
        state.failed(exc)  -> True the first time (log it), then False until Redis is back
        state.succeeded()  -> True when this rejoins after a fall back

    Parameters:
        interval: seconds between syncs while Redis answers.
        retry: seconds between tries while it does not.
        lease_s: the lease time; a block not renewed for this long is gone from Redis.
        clock: monotonic seconds.
    """

    def __init__(
        self,
        *,
        interval: float = SYNC_INTERVAL_S,
        retry: float = RETRY_S,
        lease_s: float = LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < interval < lease_s:
            raise ValueError(f"interval must be > 0 and under lease_s ({lease_s}), got {interval}")
        self.interval = interval
        self.retry = retry
        self.lease_s = lease_s
        self._clock = clock
        self.mode: Mode = "local"
        self.synced_at = -math.inf
        self.failures = 0
        self._warned = False

    def succeeded(self) -> bool:
        """A sync answered; returns whether this client just (re)joined the shared budget."""
        joined = self.mode != "shared"
        self.mode, self.synced_at, self.failures = "shared", self._clock(), 0
        rejoined = joined and self._warned
        if rejoined:
            self._warned = False
        return rejoined

    def failed(self) -> bool:
        """A sync failed: this client runs on its own loop; returns whether to log it (once per
        outage)."""
        self.mode = "local"
        self.failures += 1
        if self._warned:
            return False
        self._warned = True
        return True

    def next_delay(self) -> float:
        """Seconds until the next sync."""
        return self.interval if self.mode == "shared" else self.retry

    def block_alive(self) -> bool:
        """Whether the leases granted at the last sync are still this client's in Redis."""
        return self._clock() - self.synced_at < self.lease_s


def _client_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _load_redis() -> Any:
    try:
        import redis.asyncio as aioredis
    except ImportError as exc:  # pragma: no cover - the extra is installed in tests
        raise ImportError(
            "shared= needs redis-py (the redis package, 5 or newer): pip install 'dsclient[redis]'"
        ) from exc
    return aioredis


class Member(Protocol):
    """What a budget needs of the server it leases for (an ``Endpoint`` is one): named here,
    so that this module and ``dsclient.governor._endpoint``, which holds a budget, do not import
    each other."""

    @property
    def url(self) -> str:
        """The server's URL, for the logs."""
        ...

    @property
    def governor(self) -> Governor:
        """Its governor: the demand (in flight, waiting) published at each sync."""
        ...

    @property
    def controller(self) -> LimitController:
        """Its limit controller: the limit and capacity published at each sync."""
        ...

    def apply_shared(
        self, result: SyncResult, *, became_leader: bool, allowed: int | None = None
    ) -> None:
        """A sync answered: take its limit."""
        ...

    def leave_shared(self) -> None:
        """Redis does not answer: run on the server's own limit."""
        ...


class SharedBudget:
    """The process's side of one shared budget: a block of leases, synced in the background.

        budget = SharedBudget(secret_url, key="dsclient", server_url="http://127.0.0.1:8000")
        await budget.run(endpoint)     # until cancelled; the endpoint's governor follows it
        await budget.leave()           # gives the leases back at once

    Parameters:
        url: the Redis URL, wrapped so that no repr shows it (``reveal()`` gives it).
        key: the key prefix (several budgets on one Redis).
        server_url: the server's canonical URL; clients of the same server and key share.
        lease_s: seconds a lease lives without renewal.
        interval: seconds between syncs.
        clock: monotonic seconds (the lease times themselves are Redis's).
    """

    def __init__(
        self,
        url: _Revealable,
        *,
        key: str,
        server_url: str,
        lease_s: float = LEASE_S,
        interval: float = SYNC_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        aioredis = _load_redis()
        self._url = url
        self.display_url = redact_url(url.reveal())
        self.key = key
        self.server_url = server_url
        self.client_id = _client_id()
        self.state = SharedState(interval=interval, lease_s=lease_s, clock=clock)
        self.lease_ms = int(lease_s * 1000)
        base = f"{key}:{{{server_url}}}"
        self.keys = [f"{base}:{name}" for name in ("leases", "clients", "state", "limit")]
        self.keys += [f"{base}:leader", f"{base}:capacity"]
        self.fair_keys = [f"{base}:{name}" for name in ("vtc", "vtc-active", "vtc-waiting")]
        self._redis: Any = aioredis.Redis.from_url(
            url.reveal(),
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            health_check_interval=0,
        )
        self._script: Any = self._redis.register_script(SYNC_SCRIPT)
        self._fair_script: Any = self._redis.register_script(FAIR_SCRIPT)
        self.granted = 0
        self.allowed = 0  # what the governor may admit: min(leases held, this client's share)
        self.last: SyncResult | None = None
        self._added = 0  # leases this client put in Redis at its last sync (ids 0 .. n-1)
        self._closed = False
        #: How many times this process became the leader (for benchmarks and tests).
        self.terms = 0

    def __repr__(self) -> str:
        return (
            f"SharedBudget(url={self.display_url!r}, key={self.key!r}, mode={self.state.mode!r}, "
            f"granted={self.granted})"
        )

    @property
    def active(self) -> bool:
        """Whether the shared budget is in force (Redis answered at the last sync)."""
        return self.state.mode == "shared"

    @property
    def limit(self) -> int | None:
        """The shared limit as last read (``None`` before the first sync)."""
        return self.last.limit if self.last is not None else None

    @property
    def leader(self) -> bool:
        return self.active and self.last is not None and self.last.leader

    def _scrub(self, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        secret = urlsplit(self._url.reveal()).password
        return text.replace(secret, "***") if secret else text

    async def sync(self, endpoint: Member) -> SyncResult:
        """One round trip: publish this client's state, renew and resize its block."""
        governor = endpoint.governor
        # Calls held back for a tenant served less in another process are not demand here:
        # the limit's share goes where that tenant waits.
        in_flight, waiting = governor.in_flight, governor.waiting - governor.held_by_fairness
        demand = in_flight + waiting
        last = self.last
        target = last.target_for(self.client_id, demand, self._added) if last else max(1, demand)
        controller = endpoint.controller
        learned = endpoint.controller.capacity
        raw = await self._script(
            keys=self.keys,
            args=[
                self.client_id,
                self.lease_ms,
                self._added,
                target,
                in_flight,
                f"{demand} {in_flight} {int(governor.held_back)}",
                max(1, controller.limit),
                "" if learned is None else learned,
                0,
            ],
        )
        result = parse_sync(raw)
        self._added = result.granted
        # Leases held are never fewer than the requests in flight, but the governor admits only
        # up to the share: freed slots must not be refilled while the block is over it, or a
        # block above its share never shrinks (a shared limit cut from 64 held the server's
        # queue at 40 against a target of 12 until this was split).
        self.allowed = max(0, min(result.granted, target))
        return result

    async def sync_fair(self, governor: Governor) -> None:
        """One round trip for the tenants' counters (see "Tenants across processes"): what this
        process charged goes in, everyone's counters and marks come back. A failure loses
        nothing: the changes are added again at the next sync."""
        fair = governor.fair
        if not fair.names:
            return  # no call yet: nothing to share
        deltas = fair.take_pending()
        try:
            raw = await self._fair_script(
                keys=self.fair_keys,
                args=fair_args(
                    self.client_id,
                    self.lease_ms,
                    deltas,
                    fair.active_names(),
                    fair.waiting_names(),
                ),
            )
        except BaseException:
            fair.restore_pending(deltas)
            raise
        counters, active, waiting = parse_fair(raw)
        governor.sync_fair(counters, waiting, active)

    async def step(self, endpoint: Member) -> None:
        """One sync, applied to ``endpoint``; on failure the endpoint falls back to its own
        loop (logged once per outage)."""
        state = self.state
        if self._closed:
            return
        try:
            result = await self.sync(endpoint)
            await self.sync_fair(endpoint.governor)
        except Exception as exc:  # redis-py's errors, timeouts, OSError: Redis is away
            endpoint.governor.unsync_fair()
            if not state.block_alive():
                self._added = 0  # Redis has expired them (or lost them in a restart)
            if state.failed():
                logger.warning(
                    "dsclient: the shared budget at %s does not answer (%s); %s runs on its "
                    "own limit until it is back",
                    self.display_url,
                    self._scrub(exc),
                    endpoint.url,
                )
            endpoint.leave_shared()
            return
        previous, self.last = self.last, result
        if state.succeeded():
            logger.warning(
                "dsclient: the shared budget at %s answers again; %s shares its limit",
                self.display_url,
                endpoint.url,
            )
        self.granted = result.granted
        became_leader = result.leader and (previous is None or not previous.leader)
        self.terms += became_leader
        endpoint.apply_shared(result, became_leader=became_leader, allowed=self.allowed)

    async def first_lease(self, endpoint: Member) -> None:
        """Sync until this client holds a lease (or Redis does not answer): the others give
        room back as their requests end (at ``async with``, before the first call)."""
        await self.step(endpoint)
        while self.active and self.granted < 1 and not self._closed:
            await anyio.sleep(self.state.interval)
            await self.step(endpoint)

    async def run(self, endpoint: Member) -> None:
        """Sync until cancelled (or closed), applying each answer to ``endpoint``."""
        while not self._closed:
            await self.step(endpoint)
            await anyio.sleep(self.state.next_delay())

    async def leave(self) -> None:
        """Give every lease back and deregister (at close); quiet if Redis is away."""
        self._closed = True
        try:
            with anyio.fail_after(REDIS_TIMEOUT_S):
                await self._script(
                    keys=self.keys,
                    args=[self.client_id, self.lease_ms, self._added, 0, 0, "0 0 0", 1, "", 1],
                )
            self._added = 0
        except Exception as exc:
            logger.debug("dsclient: leaving the shared budget failed: %s", self._scrub(exc))

    async def aclose(self) -> None:
        """Leave and close the connection pool."""
        await self.leave()
        try:
            await self._redis.aclose()
        except Exception as exc:  # pragma: no cover - closing a dead pool
            logger.debug("dsclient: closing the Redis pool failed: %s", self._scrub(exc))
