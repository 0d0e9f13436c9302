"""Discovery: what server is at a URL, which model it serves, and how much it can take at once.

``discover()`` sends a handful of cheap GETs at the same time, each with a short timeout, and
merges what answered. A probe that fails (refused, 404, 401, timeout, not JSON) tells nothing
and is skipped. The parsing is pure (``parse_*`` functions, one per endpoint, each returning a
partial :class:`Facts`); the merge follows a fixed precedence, so the result does not depend on
which probe answered first.

``max_num_seqs``, first match wins:

=====================================  ===========================================================
explicit ``max_num_seqs=``             the caller knows best
launcher record                        what dsclient started the server with, if ``/v1/models``
                                       still matches it
vLLM ``/server_info``                  ``scheduler_config.max_num_seqs`` (dev mode only)
SGLang ``/v1/loads``                   effective ``max_running_requests``, summed over DP ranks
SGLang ``/server_info``                ``internal_states[].effective_max_running_requests_per_dp``
                                       x ``dp_size``, else the ``max_running_requests`` argument
TGI ``/info``                          ``max_batch_size`` when set, else
                                       ``max_concurrent_requests``
llama.cpp ``/props``                   ``total_slots``
Ollama                                 :data:`OLLAMA_DEFAULT_PARALLEL` (no endpoint reports it)
default                                :data:`DEFAULT_MAX_NUM_SEQS`
=====================================  ===========================================================

``max_model_len``: explicit, then ``/v1/models`` for the chosen model (vLLM and SGLang put
``max_model_len`` there), vLLM ``/server_info``, the launcher record, TGI ``max_total_tokens``,
llama.cpp ``n_ctx`` (per slot), Ollama ``/api/ps`` ``context_length``; else unknown (``None``).
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread

from .._exceptions import DSClientError, ResponseTooLarge, parse_json
from .._http import httpx
from .._server_info import DEFAULT_MAX_NUM_SEQS, ServerInfo, ServerKind
from .._streaming import read_body
from .._urls import root_url
from ._priority import PriorityOrder

__all__ = [
    "DEFAULT_MAX_NUM_SEQS",
    "OLLAMA_DEFAULT_PARALLEL",
    "PROBE_BODY_BYTES",
    "Facts",
    "ServerInfo",
    "ServerKind",
    "discover",
    "parse_llamacpp_props",
    "parse_models",
    "parse_ollama_ps",
    "parse_ollama_version",
    "parse_sglang_loads",
    "parse_sglang_server_info",
    "parse_tgi_info",
    "parse_version",
    "parse_vllm_server_info",
    "unreachable",
]

logger = logging.getLogger("dsclient")

#: Ollama's ``OLLAMA_NUM_PARALLEL``, which no endpoint reports. Its documented default is 1
#: (some 0.2-0.x versions chose 4 or 1 by free memory). Ollama queues what it cannot run, so
#: assuming 1 costs little when it runs more: the queue just moves to the client, where the
#: governor can order it. If you raised ``OLLAMA_NUM_PARALLEL``, pass ``max_num_seqs=``.
OLLAMA_DEFAULT_PARALLEL = 1


# --- partial results ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Facts:
    """What one endpoint told. Every field is optional; ``None`` means "not said here".

    ``model_lens`` maps served model ids to their context, for listings that give one per model.
    """

    kind: ServerKind | None = None
    version: str | None = None
    model: str | None = None
    models: tuple[str, ...] | None = None
    model_lens: Mapping[str, int] = field(default_factory=dict)
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_input_tokens: int | None = None
    #: A hard cap on requests in the server (queued ones too), past which it refuses.
    max_concurrent: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    #: The server's own priority: the order its values run in (``None``: not said) and
    #: whether it reorders by them at all (the scheduling policy).
    priority_order: PriorityOrder | None = None
    priority_honoured: bool | None = None


#: The largest count or length believed. No server runs 2**31 sequences or has a context that
#: long; a larger number is a broken or hostile answer, and taken as a limit it overflowed float
#: arithmetic downstream (``10**400`` x 0.7 raises ``OverflowError``; found by tests/test_fuzz.py).
_MOST = 2**31 - 1


def _pos_int(value: Any) -> int | None:
    """A positive int, or None (JSON booleans and floats are not counts, nor absurd numbers)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 < value <= _MOST else None


def _nonneg_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 0 <= value <= _MOST else None


def _text_int(match: re.Match[str] | None) -> int | None:
    """The positive count a regex captured. ``int()`` refuses more than 4300 digits with
    ``ValueError``, and ``max_num_seqs=0`` made ``ServerInfo`` raise: both were found by
    tests/test_fuzz.py."""
    if match is None or len(match.group(1)) > 10:
        return None
    return _pos_int(int(match.group(1)))


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _sum(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return _nonneg_int(sum(known)) if known else None


# --- parsers, one per endpoint --------------------------------------------------------------------
_OWNERS: dict[str, ServerKind] = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}


def parse_models(obj: Any) -> Facts | None:
    """``GET /v1/models`` (OpenAI shape): ids, per-model context, and ``owned_by`` as a hint.

        parse_models({"data": [{"id": "tiny", "owned_by": "vllm", "max_model_len": 2048}]})
        # Facts(kind="vllm", models=("tiny",), model_lens={"tiny": 2048})

    vLLM and SGLang set ``owned_by`` to ``"vllm"`` / ``"sglang"`` and give ``max_model_len``;
    llama.cpp sets ``"llamacpp"``. Ollama and TGI put other things there, so no kind from them.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        return None
    ids: list[str] = []
    lens: dict[str, int] = {}
    owners: set[str] = set()
    for entry in obj["data"]:
        if not isinstance(entry, dict) or _str(entry.get("id")) is None:
            continue
        model_id: str = entry["id"]
        if model_id in ids:
            continue
        ids.append(model_id)
        n = _pos_int(entry.get("max_model_len"))
        if n is not None:
            lens[model_id] = n
        if isinstance(entry.get("owned_by"), str):
            owners.add(entry["owned_by"])
    kind = _OWNERS.get(owners.pop()) if len(owners) == 1 else None
    return Facts(kind=kind, models=tuple(ids), model_lens=lens)


def parse_version(obj: Any) -> Facts | None:
    """vLLM ``GET /version``: ``{"version": "0.32.0"}``."""
    if not isinstance(obj, dict) or _str(obj.get("version")) is None:
        return None
    return Facts(kind="vllm", version=obj["version"])


_VLLM_TEXT_FIELDS = {
    "max_num_seqs": re.compile(r"\bmax_num_seqs=(\d+)"),
    "max_model_len": re.compile(r"\bmax_(?:model|seq)_len=(\d+)"),
}


def _maybe_json(value: Any) -> Any:
    """A JSON string holding JSON becomes the value it holds; anything else stays as it is."""
    if isinstance(value, str) and value.lstrip()[:1] in ("{", "["):
        try:
            return parse_json(value)
        except ValueError:
            return value
    return value


def parse_vllm_server_info(obj: Any) -> Facts | None:
    """vLLM ``GET /server_info?config_format=json`` (only with ``VLLM_SERVER_DEV_MODE=1``).

        parse_vllm_server_info({"vllm_config": {"scheduler_config": {"max_num_seqs": 8},
                                                "model_config": {"max_model_len": 2048}}})

    vLLM 0.32 gives ``vllm_config`` as an object. Other versions give the whole body or the
    ``vllm_config`` value as a string holding JSON, and versions without ``config_format`` give
    ``str(vllm_config)`` (``"model='x', ..., max_seq_len=2048, ..."``), read with a regex.
    """
    obj = _maybe_json(obj)
    if not isinstance(obj, dict) or "vllm_config" not in obj:
        return None
    config = _maybe_json(obj["vllm_config"])
    if isinstance(config, dict):
        scheduler = _maybe_json(config.get("scheduler_config"))
        model_config = _maybe_json(config.get("model_config"))
        seqs = _pos_int(scheduler.get("max_num_seqs")) if isinstance(scheduler, dict) else None
        length = (
            _pos_int(model_config.get("max_model_len")) if isinstance(model_config, dict) else None
        )
        policy = scheduler.get("policy") if isinstance(scheduler, dict) else None
        if policy in ("priority", "fcfs"):
            return Facts(
                kind="vllm",
                max_num_seqs=seqs,
                max_model_len=length,
                priority_order="lower-first",
                priority_honoured=policy == "priority",
            )
    elif isinstance(config, str):
        seqs = _text_int(_VLLM_TEXT_FIELDS["max_num_seqs"].search(config))
        length = _text_int(_VLLM_TEXT_FIELDS["max_model_len"].search(config))
    else:
        return None
    return Facts(kind="vllm", max_num_seqs=seqs, max_model_len=length)


def parse_sglang_loads(obj: Any) -> Facts | None:
    """SGLang ``GET /v1/loads``: per-DP-rank ``max_running_requests`` and live queue counts.

        parse_sglang_loads({"loads": [{"dp_rank": 0, "max_running_requests": 128,
                                       "num_running_reqs": 3, "num_waiting_reqs": 0}]})

    The body is ``{"version", "timestamp", "loads": [GetLoadsReqOutput, ...]}`` with one entry per
    data-parallel rank (sglang ``managers/io_struct.py``: ``dp_rank``, ``num_running_reqs``,
    ``num_waiting_reqs``, ``max_running_requests``, ``max_total_num_tokens``, ...); a bare list
    is accepted too. The server's capacity is the sum over ranks.
    """
    entries = obj.get("loads") if isinstance(obj, dict) else obj
    if not isinstance(entries, list):
        return None
    ranks = [e for e in entries if isinstance(e, dict) and "num_running_reqs" in e]
    if not ranks:
        return None
    return Facts(
        kind="sglang",
        version=_str(obj.get("version")) if isinstance(obj, dict) else None,
        max_num_seqs=_sum([_pos_int(e.get("max_running_requests")) for e in ranks]),
        num_running=_sum([_nonneg_int(e.get("num_running_reqs")) for e in ranks]),
        num_waiting=_sum([_nonneg_int(e.get("num_waiting_reqs")) for e in ranks]),
    )


def parse_sglang_server_info(obj: Any) -> Facts | None:
    """SGLang ``GET /server_info`` (old: ``/get_server_info``): server args plus scheduler state.

        parse_sglang_server_info({"model_path": "Qwen/Qwen2.5-0.5B", "max_running_requests": None,
                                  "dp_size": 1, "version": "0.5.2",
                                  "internal_states": [{"effective_max_running_requests_per_dp":
                                                       128}]})

    The body is ``{**server_args, **scheduler_info, "internal_states": [...], "version"}``
    (sglang ``entrypoints/http_server.py``). ``max_running_requests`` is the launch argument and
    often ``null``; the scheduler's effective value per DP rank is in ``internal_states``.
    """
    if not isinstance(obj, dict) or "vllm_config" in obj:
        return None
    states = obj.get("internal_states")
    if "max_running_requests" not in obj and not isinstance(states, list):
        return None
    per_dp = None
    if isinstance(states, list) and states and isinstance(states[0], dict):
        per_dp = _pos_int(states[0].get("effective_max_running_requests_per_dp"))
    dp_size = _pos_int(obj.get("dp_size")) or 1
    seqs = _pos_int(per_dp * dp_size) if per_dp is not None else None
    seqs = seqs or _pos_int(obj.get("max_running_requests"))
    served = obj.get("served_model_name")
    enabled = obj.get("enable_priority_scheduling")
    order: PriorityOrder | None = None
    if enabled is True:
        low_first = obj.get("schedule_low_priority_values_first") is True
        order = "lower-first" if low_first else "higher-first"
    return Facts(
        kind="sglang",
        priority_order=order,
        priority_honoured=enabled if isinstance(enabled, bool) else None,
        version=_str(obj.get("version")),
        model=_str(served) or _str(obj.get("model_path")),
        max_num_seqs=seqs,
        max_model_len=_pos_int(obj.get("context_length")),
        max_input_tokens=_pos_int(obj.get("max_req_input_len")),
    )


def parse_tgi_info(obj: Any) -> Facts | None:
    """TGI ``GET /info`` (router ``Info`` struct).

        parse_tgi_info({"model_id": "mistralai/Ministral-8B-Instruct-2410",
                        "max_concurrent_requests": 128, "max_input_tokens": 32767,
                        "max_total_tokens": 32768, "router": "text-generation-router",
                        "version": "3.2.1"})

    TGI 1.x names the input limit ``max_input_length``. ``max_concurrent_requests`` (default 128)
    is the router's admission limit, past which it answers 429 "Model is overloaded", not the
    batch size: it is the hard cap (``max_concurrent``); ``max_batch_size``, where the server
    reports it, is the batch.
    """
    if not isinstance(obj, dict):
        return None
    if "max_concurrent_requests" not in obj and obj.get("router") != "text-generation-router":
        return None
    return Facts(
        kind="tgi",
        version=_str(obj.get("version")),
        model=_str(obj.get("model_id")),
        max_num_seqs=_pos_int(obj.get("max_batch_size")),
        max_concurrent=_pos_int(obj.get("max_concurrent_requests")),
        max_model_len=_pos_int(obj.get("max_total_tokens")),
        max_input_tokens=_pos_int(obj.get("max_input_tokens"))
        or _pos_int(obj.get("max_input_length")),
    )


def parse_llamacpp_props(obj: Any) -> Facts | None:
    """llama.cpp server ``GET /props``.

        parse_llamacpp_props({"default_generation_settings": {"n_ctx": 8192},
                              "total_slots": 1, "model_path": "models/model.gguf",
                              "build_info": "b5000-abc"})

    ``total_slots`` is ``--parallel``; ``default_generation_settings.n_ctx`` is the context of
    one slot (the whole ``--ctx-size`` is split between slots), which is what one request gets.
    """
    if not isinstance(obj, dict):
        return None
    settings = obj.get("default_generation_settings")
    if "total_slots" not in obj and not isinstance(settings, dict):
        return None
    n_ctx = _pos_int(settings.get("n_ctx")) if isinstance(settings, dict) else None
    return Facts(
        kind="llamacpp",
        version=_str(obj.get("build_info")),
        model=_str(obj.get("model_alias")) or _str(obj.get("model_path")),
        max_num_seqs=_pos_int(obj.get("total_slots")),
        max_model_len=n_ctx,
    )


def parse_ollama_version(obj: Any) -> Facts | None:
    """Ollama ``GET /api/version``: ``{"version": "0.5.7"}``."""
    if not isinstance(obj, dict) or _str(obj.get("version")) is None:
        return None
    return Facts(kind="ollama", version=obj["version"])


def parse_ollama_ps(obj: Any) -> Facts | None:
    """Ollama ``GET /api/ps``: loaded models, with ``context_length`` in recent versions.

        parse_ollama_ps({"models": [{"name": "qwen3:8b", "model": "qwen3:8b",
                                     "size_vram": 4600000000, "context_length": 8192}]})

    Only models loaded right now are listed, so this gives per-model contexts, not the list of
    models (that is ``/v1/models``).
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("models"), list):
        return None
    lens: dict[str, int] = {}
    for entry in obj["models"]:
        if not isinstance(entry, dict):
            continue
        n = _pos_int(entry.get("context_length"))
        if n is None:
            continue
        for key in ("name", "model"):
            if _str(entry.get(key)) is not None:
                lens[entry[key]] = n
    return Facts(kind="ollama", model_lens=lens)


#: vLLM's V1 engine (the only one from 0.10) accepts a priority on a first-come server.
_VLLM_PRIORITY_SAFE = (0, 10)


def _version_tuple(version: str | None) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match[1]), int(match[2])) if match else None


def _priority_of(
    kind: ServerKind,
    version: str | None,
    facts: Mapping[str, Facts | None],
    record: Any,
    explicit: bool | None,
    sources: dict[str, str],
) -> tuple[PriorityOrder | None, bool | None]:
    """Whether to send the server's ``priority``, in which order, and whether it honours it."""
    if explicit is False:
        sources["priority"] = "explicit"
        return None, False
    for key, label in (
        ("vllm_server_info", "vllm /server_info"),
        ("sglang_server_info", "sglang /server_info"),
        ("sglang_get_server_info", "sglang /get_server_info"),
    ):
        found = facts.get(key)
        if found is not None and found.priority_honoured is not None:
            if explicit:
                sources["priority"] = "explicit"
                return found.priority_order or "lower-first", True
            sources["priority"] = label
            return found.priority_order, found.priority_honoured
    policy = getattr(record, "scheduling_policy", None)
    order: PriorityOrder = "higher-first" if kind == "sglang" else "lower-first"
    if explicit:
        sources["priority"] = "explicit"
        return order, True
    if kind == "vllm" and policy in ("priority", "fcfs"):
        sources["priority"] = "launcher record"
        return "lower-first", policy == "priority"
    known = _version_tuple(version)
    if kind == "vllm" and known is not None and known >= _VLLM_PRIORITY_SAFE:
        sources["priority"] = "vllm /version (V1 engine: accepted, honoured if its policy is)"
        return "lower-first", None
    return None, None


# --- records ------------------------------------------------------------------------------------
class RecordSource(Protocol):
    """What :func:`discover` needs from the launcher's records (``dsclient._records``)."""

    def read_record(self, url: str) -> Any: ...

    def record_matches(self, record: Any, models_json: dict[str, Any]) -> bool: ...


def _default_records() -> RecordSource | None:
    try:
        from .. import _records  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return None
    return _records  # type: ignore[no-any-return, unused-ignore]


async def _read_record(
    records: RecordSource | None, url: str, models_json: Any
) -> tuple[Any, str | None]:
    """The launcher's record for ``url`` if it still describes the live server, else None."""
    if records is None:
        return None, None
    try:
        # A small file read, but a file read: keep it off the event loop.
        record = await anyio.to_thread.run_sync(records.read_record, url)
    except Exception as exc:  # a broken record must not break discovery
        logger.warning("dsclient: ignoring the launch record for %s: %r", url, exc)
        return None, None
    if record is None:
        return None, None
    if not isinstance(models_json, dict):
        return None, "launch record found, but /v1/models did not answer to confirm it"
    try:
        matches = records.record_matches(record, models_json)
    except Exception as exc:
        logger.warning("dsclient: could not check the launch record for %s: %r", url, exc)
        return None, None
    if not matches:
        return None, "launch record found, but the live server no longer matches it"
    return record, None


# --- probing -------------------------------------------------------------------------------------
# path -> parsers tried on its answer. One request to /server_info serves vLLM and SGLang alike:
# SGLang ignores the query string.
_PROBES: dict[str, str] = {
    "models": "/v1/models",
    "version": "/version",
    "server_info": "/server_info?config_format=json",
    "get_server_info": "/get_server_info",
    "loads": "/v1/loads",
    "tgi": "/info",
    "props": "/props",
    "ollama_version": "/api/version",
    "ollama_ps": "/api/ps",
}


#: The most bytes of a probe's answer read. The largest seen are vLLM's ``/server_info`` (the
#: whole config, tens of KiB) and a ``/v1/models`` listing many adapters; beyond this the probe
#: tells nothing, like one that failed.
PROBE_BODY_BYTES = 4 * 2**20


#: Statuses that say nothing about a route, only that the server could not answer just now.
_PASSING_STATUSES = frozenset({408, 425, 429})


def unreachable(exc: BaseException, url: str) -> str:
    """What a failed connection to ``url`` says, in a newcomer's words.

        unreachable(httpx.ConnectError(...), "http://127.0.0.1:8001/v1/models")
        # "nothing listens on 127.0.0.1:8001 (connection refused)"

    The layers below wrap the operating system's error (``ConnectionRefusedError``,
    ``socket.gaierror``) in their own; the chain of causes is searched for it.
    """
    target = httpx.URL(url)
    host = target.host or url
    port = target.port or (443 if target.scheme == "https" else 80)
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError):
            return f"nothing listens on {host}:{port} (connection refused)"
        if isinstance(seen, socket.gaierror):
            return f"no such host {host!r} (the name does not resolve: {seen.strerror or seen})"
        if isinstance(seen, UnicodeError):
            return f"no such host {host!r} (not a valid host name)"
        if isinstance(seen, (httpx.TimeoutException, TimeoutError)):
            return f"{host}:{port} did not answer in time ({type(exc).__name__})"
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    if "Name or service not known" in text or "nodename nor servname" in text:
        return f"no such host {host!r} ({text})"
    if "refused" in text.lower():
        return f"nothing listens on {host}:{port} ({text})"
    return f"could not connect to {host}:{port} ({type(exc).__name__}: {text})"


def _shown(body: bytes, http: httpx.AsyncClient) -> str:
    """The start of an answer that was not JSON, for an error message; the API key blanked
    out, should the page echo the request's headers (a debugging proxy's does)."""
    text = " ".join(body[:2000].decode("utf-8", "replace").split())
    scheme, _, token = http.headers.get("authorization", "").partition(" ")
    secret = token.strip() or scheme.strip()
    if len(secret) >= 6:
        text = text.replace(secret, "***")
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


async def _get_json(
    http: httpx.AsyncClient, url: str, seconds: float
) -> tuple[Any | None, bool, str | None]:
    """GET and decode JSON, reading at most :data:`PROBE_BODY_BYTES`: ``(json, answered, why)``.

    Any failure gives ``None`` for the JSON, and ``why`` says what went wrong in words a
    message can quote ("nothing listens on 127.0.0.1:8001 (connection refused)", "HTTP 200
    text/html, not JSON: '<!DOCTYPE html>...'"). ``answered`` tells a route the server does not
    have or will not serve (a 4xx: ask again and the answer is the same) from a probe that got
    no answer (a connection error, a timeout, a 5xx or 429, an unreadable body), which is worth
    trying again later."""
    with anyio.move_on_after(seconds):  # httpx's timeout is per phase; bound the whole probe
        try:
            response = await http.send(http.build_request("GET", url, timeout=seconds), stream=True)
        except httpx.HTTPError as exc:
            logger.debug("dsclient: probe %s failed: %r", url, exc)
            return None, False, unreachable(exc, url)
        try:
            if response.status_code != 200:
                logger.debug("dsclient: probe %s answered HTTP %d", url, response.status_code)
                status = response.status_code
                why = f"answered HTTP {status}"
                return None, status < 500 and status not in _PASSING_STATUSES, why
            body = await read_body(response, limit=PROBE_BODY_BYTES)
            try:
                return parse_json(body), True, None
            except ValueError:
                kind = response.headers.get("content-type", "no content-type").split(";")[0]
                why = f"answered HTTP 200 {kind}, not JSON: {_shown(body, http)}"
                logger.debug("dsclient: probe %s %s", url, why)
                return None, False, why
        except ResponseTooLarge as exc:
            logger.warning("dsclient: probe %s ignored: %s", url, exc)
            return None, True, str(exc)  # asking again brings the same oversized answer
        except (DSClientError, ValueError, httpx.HTTPError) as exc:
            logger.debug("dsclient: probe %s gave nothing usable: %r", url, exc)
            return None, False, f"its answer could not be read ({type(exc).__name__}: {exc})"
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
    logger.debug("dsclient: probe %s timed out", url)
    return None, False, f"no answer within {seconds:g} s"


async def discover(
    http: httpx.AsyncClient,
    url: str,
    *,
    model: str | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    timeout: float = 2.0,
    records: RecordSource | Literal["auto"] | None = "auto",
    unlisted: Literal["warn", "raise"] = "warn",
    priority: bool | None = None,
) -> ServerInfo:
    """Find the server's kind, version, models and limits.

        async with httpx.AsyncClient() as http:
            info = await discover(http, "http://127.0.0.1:8000")
        info.max_num_seqs, info.sources["max_num_seqs"]     # 8, "vllm /server_info"

    Parameters:
        http: a client already set up with auth headers and transport.
        url: the server's root URL (a trailing ``/v1`` is dropped).
        model: the model to use; ``None`` takes the server's only model.
        max_num_seqs: the server's concurrent-sequence limit, when the caller knows it.
        max_model_len: the model's context, when the caller knows it.
        timeout: seconds for each probe; the probes run at the same time.
        records: where launch records come from; ``"auto"`` is ``dsclient._records`` when it
            exists, ``None`` turns records off. Tests inject a fake here.
        unlisted: a ``model`` the server does not list is tried with a warning (``"warn"``:
            transformers' server lists only its cache and loads others on demand, a gateway
            may route names it does not list), or refused (``"raise"``: a pool, whose other
            servers may list it).
        priority: the caller's word on the server's priority scheduling: ``True`` it reorders
            by ``priority`` (send it), ``False`` never send it, ``None`` find out.

    Raises:
        ValueError: ``model`` is not among the served models and ``unlisted="raise"``, or none
            is given and several are served (the message lists them); or an explicit limit is
            not a positive int.
    """
    for name, value in (("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if value is not None and value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    root = root_url(url)
    answers: dict[str, Any] = {}
    answered: dict[str, bool] = {}
    probe_failed: dict[str, str | None] = {}

    async def probe(key: str, path: str) -> None:
        answers[key], answered[key], probe_failed[key] = await _get_json(http, root + path, timeout)

    async with anyio.create_task_group() as tg:
        for key, path in _PROBES.items():
            tg.start_soon(probe, key, path)

    facts = {
        "models": parse_models(answers.get("models")),
        "vllm_version": parse_version(answers.get("version")),
        "vllm_server_info": parse_vllm_server_info(answers.get("server_info")),
        "sglang_loads": parse_sglang_loads(answers.get("loads")),
        "sglang_server_info": parse_sglang_server_info(answers.get("server_info")),
        "sglang_get_server_info": parse_sglang_server_info(answers.get("get_server_info")),
        "tgi": parse_tgi_info(answers.get("tgi")),
        "llamacpp": parse_llamacpp_props(answers.get("props")),
        "ollama_version": parse_ollama_version(answers.get("ollama_version")),
        "ollama_ps": parse_ollama_ps(answers.get("ollama_ps")),
    }
    labels = {
        "models": "/v1/models",
        "vllm_version": "vllm /version",
        "vllm_server_info": "vllm /server_info",
        "sglang_loads": "sglang /v1/loads",
        "sglang_server_info": "sglang /server_info",
        "sglang_get_server_info": "sglang /get_server_info",
        "tgi": "tgi /info",
        "llamacpp": "llama.cpp /props",
        "ollama_version": "ollama /api/version",
        "ollama_ps": "ollama /api/ps",
    }
    sources: dict[str, str] = {}
    if facts["models"] is None:
        # What the listing answered instead, for the messages of calls that need it.
        sources["/v1/models"] = probe_failed.get("models") or "not the OpenAI model list"

    # -- kind: the most specific signal first. /version alone is weak (other servers may have
    # one), so it only decides when nothing more specific answered.
    kind: ServerKind = "unknown"
    kind_order = [
        "models",
        "vllm_server_info",
        "tgi",
        "llamacpp",
        "sglang_loads",
        "sglang_server_info",
        "sglang_get_server_info",
        "ollama_version",
        "vllm_version",
    ]
    for key in kind_order:
        found = facts[key]
        if found is not None and found.kind is not None:
            kind = found.kind
            sources["kind"] = labels[key] + (" owned_by" if key == "models" else "")
            break
    else:
        if facts["models"] is not None:
            kind, sources["kind"] = "openai-compatible", "/v1/models"

    version_key = {
        "vllm": ["vllm_version"],
        "sglang": ["sglang_server_info", "sglang_get_server_info", "sglang_loads"],
        "tgi": ["tgi"],
        "llamacpp": ["llamacpp"],
        "ollama": ["ollama_version"],
    }.get(kind, [])
    version = None
    for key in version_key:
        found = facts[key]
        if found is not None and found.version is not None:
            version, sources["version"] = found.version, labels[key]
            break

    # -- model choice
    listing = facts["models"]
    served = listing.models if listing is not None else None
    if model is not None:
        sources["model"] = "explicit"
        if served is not None and model not in served:
            listed = ", ".join(map(repr, served)) or "(none)"
            if unlisted == "raise":
                raise ValueError(f"model {model!r} is not served at {root}; it serves: {listed}")
            logger.warning(
                "dsclient: %s does not list model %r (it lists: %s); trying it anyway: some "
                "servers load models on demand, and a gateway may route names it does not list",
                root,
                model,
                listed,
            )
            sources["model"] = "explicit (not listed by /v1/models)"
    elif served:
        if len(served) > 1:
            raise ValueError(
                f"{root} serves {len(served)} models; choose one with model=: "
                f"{', '.join(map(repr, served))}"
            )
        model, sources["model"] = served[0], "/v1/models"

    # -- the launcher's record, trusted only if the live /v1/models still matches it
    record_source = _default_records() if isinstance(records, str) else records
    record, why_not = await _read_record(record_source, root, answers.get("models"))
    if why_not:
        logger.info("dsclient: %s: %s", root, why_not)

    def record_value(name: str) -> int | None:
        return _pos_int(getattr(record, name, None)) if record is not None else None

    # -- max_num_seqs: first match wins
    seqs_chain: list[tuple[str, int | None]] = [
        ("explicit", max_num_seqs),
        ("launcher record", record_value("max_num_seqs")),
    ]
    for key in (
        "vllm_server_info",
        "sglang_loads",
        "sglang_server_info",
        "sglang_get_server_info",
        "tgi",
        "llamacpp",
    ):
        found = facts[key]
        seqs_chain.append((labels[key], found.max_num_seqs if found is not None else None))
    if kind == "ollama":
        seqs_chain.append(("ollama default", OLLAMA_DEFAULT_PARALLEL))
    seqs_chain.append(("default", DEFAULT_MAX_NUM_SEQS))
    seqs_source, seqs = next((s, v) for s, v in seqs_chain if v is not None)
    assert seqs is not None
    sources["max_num_seqs"] = seqs_source

    # -- max_model_len: first match wins; the live per-model listing beats configuration
    def per_model(key: str) -> int | None:
        found = facts[key]
        return found.model_lens.get(model) if found is not None and model is not None else None

    def said(key: str) -> int | None:
        found = facts[key]
        return found.max_model_len if found is not None else None

    len_chain: list[tuple[str, int | None]] = [
        ("explicit", max_model_len),
        ("/v1/models", per_model("models")),
        ("vllm /server_info", said("vllm_server_info")),
        ("launcher record", record_value("max_model_len")),
        ("sglang /server_info", said("sglang_server_info")),
        ("sglang /get_server_info", said("sglang_get_server_info")),
        ("tgi /info", said("tgi")),
        ("llama.cpp /props", said("llamacpp")),
        ("ollama /api/ps", per_model("ollama_ps")),
    ]
    length_source, length = next(((s, v) for s, v in len_chain if v is not None), (None, None))
    if length_source is not None:
        sources["max_model_len"] = length_source

    max_input = None
    for key in ("tgi", "sglang_server_info", "sglang_get_server_info"):
        found = facts[key]
        if found is not None and found.max_input_tokens is not None:
            max_input, sources["max_input_tokens"] = found.max_input_tokens, labels[key]
            break

    order, honoured = _priority_of(kind, version, facts, record, priority, sources)

    hard_cap = None
    found_tgi = facts["tgi"]
    if found_tgi is not None and found_tgi.max_concurrent is not None:
        hard_cap, sources["max_concurrent"] = found_tgi.max_concurrent, labels["tgi"]

    info = ServerInfo(
        url=root,
        kind=kind,
        priority=order,
        priority_honoured=honoured,
        version=version,
        model=model,
        models=served or (),
        max_model_len=length,
        max_num_seqs=seqs,
        max_input_tokens=max_input,
        max_concurrent=hard_cap,
        has_tokenize=kind == "vllm",
        sources=sources,
        complete=answered.get("models", False) or facts["models"] is not None,
    )
    logger.debug("dsclient: discovered %r", info)
    return info
