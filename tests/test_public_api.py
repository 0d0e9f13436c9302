"""The package exports exactly its public names, sorted."""

import dsclient

EXPECTED = {
    "USE_DEFAULT",
    "BatchResults",
    "AsyncClient",
    "ChatResult",
    "Client",
    "CompletionResult",
    "ConnectionError",
    "ContextOverflow",
    "ControlStats",
    "DSClientError",
    "Failure",
    "GovernorStats",
    "LaneStats",
    "MalformedResponse",
    "Overloaded",
    "RequestRefused",
    "Result",
    "Retry",
    "ServerError",
    "ServerInfo",
    "Stream",
    "SyncStream",
    "TimeoutError",
    "TransportError",
    "Usage",
    "__version__",
    "compute_backoff",
}


def test_all_is_exactly_the_public_names():
    assert set(dsclient.__all__) == EXPECTED
    assert list(dsclient.__all__) == sorted(dsclient.__all__, key=lambda s: (not s.isupper(), s))


def test_every_export_exists():
    for name in dsclient.__all__:
        assert hasattr(dsclient, name), name


def test_exception_tree():
    assert issubclass(dsclient.ContextOverflow, dsclient.RequestRefused)
    assert issubclass(dsclient.Overloaded, dsclient.RequestRefused)
    assert issubclass(dsclient.RequestRefused, dsclient.ServerError)
    assert issubclass(dsclient.TimeoutError, dsclient.TransportError)
    assert issubclass(dsclient.ConnectionError, dsclient.TransportError)
    for name in ("ServerError", "TransportError", "MalformedResponse"):
        assert issubclass(getattr(dsclient, name), dsclient.DSClientError)
