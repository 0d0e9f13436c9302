"""What is known about a server: :class:`ServerInfo`, the result of discovery.

    info = client.server                       # a ServerInfo
    info.kind, info.model, info.max_num_seqs   # "vllm", "tiny", 8

A plain value, shared by the layers that learn it (the client's discovery,
``dsclient.client._discovery``) and those that read it (the governor sizes a server's limit from
``max_num_seqs``; the command line prints it). It lives in the core so that reading it asks
nothing of the client.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = ["DEFAULT_MAX_NUM_SEQS", "PriorityOrder", "ServerInfo", "ServerKind"]

ServerKind = Literal["vllm", "sglang", "tgi", "llamacpp", "ollama", "openai-compatible", "unknown"]

#: Which values a server runs first: vLLM ``"lower-first"``, SGLang ``"higher-first"`` (default).
#: See ``dsclient.client._priority``.
PriorityOrder = Literal["lower-first", "higher-first"]

#: ``max_num_seqs`` assumed when nothing tells it. This is the common case for vLLM, which only
#: reports it in dev mode. 8 gives a client cap of 5 (70%): it never overloads even a small CPU
#: server (the one measured here ran ``--max-num-seqs 8``; its throughput was already flat from
#: 8 in flight), while a GPU server with vLLM's default of 256 only loses throughput, never
#: requests. Pass ``max_num_seqs=`` or launch through dsclient to use a large server fully.
DEFAULT_MAX_NUM_SEQS = 8


@dataclass(frozen=True, kw_only=True)
class ServerInfo:
    """What discovery (:func:`~dsclient.client._discovery.discover`) found about a server.

        info = await discover(http, "http://127.0.0.1:8000")
        info.kind, info.model, info.max_model_len, info.max_num_seqs   # "vllm", "tiny", 2048, 8
        print(info)                                                     # a table, with sources

    ``sources`` says where each of ``kind``, ``version``, ``model``, ``max_model_len`` and
    ``max_num_seqs`` came from ("explicit", "launcher record", "vllm /server_info", "/v1/models",
    "default", ...). ``has_tokenize`` is true when the server has vLLM's ``POST /tokenize``.
    ``max_input_tokens`` is the prompt limit when the server has one apart from the context
    (TGI, SGLang). ``complete`` is false when ``/v1/models`` gave no answer (a connection error,
    a timeout, a 5xx, a garbled body): the model and context are then unknown, not absent, and
    the client asks again (see ``AsyncClient``). ``priority`` is the order in which the client
    sends each call's ``priority`` field (``"lower-first"``: vLLM; ``"higher-first"``: SGLang;
    ``None``: not sent, the server is not known to take it) and ``priority_honoured`` whether
    the server reorders by it (``None``: not known); see ``dsclient.client._priority``.
    ``max_concurrent`` is a hard cap the server states and refuses past (TGI's
    ``max_concurrent_requests``: 429 "Model is overloaded"), a ceiling on what the client
    sends; ``max_num_seqs`` is the batch it runs and queues behind, where the client's limit
    starts and, unless completions prove more, stops.
    """

    url: str
    kind: ServerKind
    version: str | None = None
    model: str | None = None
    models: tuple[str, ...] = ()
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_input_tokens: int | None = None
    max_concurrent: int | None = None
    has_tokenize: bool = False
    sources: Mapping[str, str] = field(default_factory=dict)
    complete: bool = True
    priority: PriorityOrder | None = None
    priority_honoured: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ValueError(
                f"ServerInfo.max_num_seqs must be an int >= 1, got {self.max_num_seqs}"
            )
        # Read-only view, so the frozen dataclass is frozen all the way down.
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``models`` as a list, ``sources`` as a plain dict)."""
        return {
            "url": self.url,
            "kind": self.kind,
            "version": self.version,
            "model": self.model,
            "models": list(self.models),
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_input_tokens": self.max_input_tokens,
            "max_concurrent": self.max_concurrent,
            "has_tokenize": self.has_tokenize,
            "sources": dict(self.sources),
            "complete": self.complete,
            "priority": self.priority,
            "priority_honoured": self.priority_honoured,
        }

    def __str__(self) -> str:
        def show(value: object) -> str:
            return "-" if value is None else str(value)

        rows = [
            ("url", self.url, None),
            ("kind", self.kind, "kind"),
            ("version", show(self.version), "version"),
            ("model", show(self.model), "model"),
            ("models", ", ".join(self.models) or "-", None),
            ("max_model_len", show(self.max_model_len), "max_model_len"),
            ("max_num_seqs", str(self.max_num_seqs), "max_num_seqs"),
            ("max_input_tokens", show(self.max_input_tokens), "max_input_tokens"),
            ("max_concurrent", _cap_text(self.max_concurrent), "max_concurrent"),
            ("/tokenize", "yes" if self.has_tokenize else "no", None),
            ("priority", _priority_text(self.priority, self.priority_honoured), "priority"),
        ]
        if not self.complete:
            rows.append(("/v1/models", "no answer (asked again later)", None))
        width = max(len(name) for name, _, _ in rows)
        value_width = min(40, max(len(value) for _, value, _ in rows))
        lines = []
        for name, value, key in rows:
            source = self.sources.get(key) if key else None
            line = f"{name:<{width}}  {value:<{value_width}}"
            lines.append(f"{line}  ({source})" if source else line.rstrip())
        return "\n".join(lines)


def _cap_text(cap: int | None) -> str:
    return "-" if cap is None else f"{cap} (hard cap: refused past it)"


def _priority_text(order: PriorityOrder | None, honoured: bool | None) -> str:
    if order is None:
        return "not sent"
    said = {True: "honoured", False: "ignored (first-come)", None: "honoured?"}[honoured]
    return f"sent, {order}, {said}"
