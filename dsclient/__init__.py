"""dsclient: call self-hosted LLM servers at high concurrency without drowning them.

import dsclient

async with dsclient.AsyncClient("http://127.0.0.1:8000") as client:
    result = await client.generate("Hello", max_tokens=16)
"""

from ._batch import BatchResults
from ._client import USE_DEFAULT, AsyncClient, Stream
from ._control import ControlStats
from ._degrade import Degrade
from ._discovery import ServerInfo
from ._endpoint import ServerView
from ._exceptions import (
    ConnectionError,
    ContextOverflow,
    DSClientError,
    MalformedResponse,
    Overloaded,
    RequestRefused,
    ResponseTooLarge,
    ServerError,
    TimeoutError,
    TransportError,
)
from ._governor import GovernorStats, LaneStats
from ._health import Reachability
from ._load import Load
from ._models import ChatResult, CompletionResult, Failure, Result, Usage
from ._observe import CallRecord
from ._pool import NoServerError
from ._retry import Retry, compute_backoff
from ._routing import RoutingPolicy
from ._sync import Client, SyncStream

__version__ = "0.1.0"

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
