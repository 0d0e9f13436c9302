"""dsclient: call self-hosted LLM servers at high concurrency without drowning them.

import dsclient

async with dsclient.AsyncClient("http://127.0.0.1:8000") as client:
    result = await client.generate("Hello", max_tokens=16)
"""

from ._exceptions import (
    ConnectionError,
    ContextOverflow,
    DSClientError,
    MalformedResponse,
    Overloaded,
    RequestRefused,
    ResponseTooLarge,
    ServerError,
    ServerFault,
    TimeoutError,
    TransportError,
)
from ._models import ChatResult, CompletionResult, Failure, Result, Usage
from ._observe import CallRecord
from ._server_info import ServerInfo
from ._version import __version__
from .batch._batch import BatchResults
from .client._client import USE_DEFAULT, AsyncClient, Stream
from .client._degrade import Degrade
from .client._retry import Retry, compute_backoff
from .client._sync import Client, SyncStream
from .governor._control import ControlStats
from .governor._endpoint import ServerView
from .governor._governor import GovernorStats, LaneStats
from .governor._health import Reachability
from .governor._load import Load
from .governor._pool import NoServerError
from .governor._routing import RoutingPolicy

__all__ = [
    "USE_DEFAULT",
    "AsyncClient",
    "BatchResults",
    "CallRecord",
    "ChatResult",
    "Client",
    "CompletionResult",
    "ConnectionError",
    "ContextOverflow",
    "ControlStats",
    "DSClientError",
    "Degrade",
    "Failure",
    "GovernorStats",
    "LaneStats",
    "Load",
    "MalformedResponse",
    "NoServerError",
    "Overloaded",
    "Reachability",
    "RequestRefused",
    "ResponseTooLarge",
    "Result",
    "Retry",
    "RoutingPolicy",
    "ServerError",
    "ServerFault",
    "ServerInfo",
    "ServerView",
    "Stream",
    "SyncStream",
    "TimeoutError",
    "TransportError",
    "Usage",
    "__version__",
    "compute_backoff",
]
