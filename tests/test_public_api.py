"""The package exports exactly its public names, sorted."""

import builtins

import dsclient

EXPECTED = {
    "USE_DEFAULT",
    "BatchResults",
    "CallRecord",
    "Load",
    "Degrade",
    "NoServerError",
    "RoutingPolicy",
    "ServerView",
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
    "Reachability",
    "ResponseTooLarge",
    "Overloaded",
    "RequestRefused",
    "Result",
    "Retry",
    "ServerError",
    "ServerFault",
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
    assert issubclass(dsclient.ServerFault, dsclient.RequestRefused)
    assert issubclass(dsclient.TimeoutError, builtins.TimeoutError)
    assert issubclass(dsclient.ConnectionError, builtins.ConnectionError)
    assert issubclass(dsclient.RequestRefused, dsclient.ServerError)
    assert issubclass(dsclient.TimeoutError, dsclient.TransportError)
    assert issubclass(dsclient.ConnectionError, dsclient.TransportError)
    assert issubclass(dsclient.ResponseTooLarge, dsclient.MalformedResponse)
    for name in ("ServerError", "TransportError", "MalformedResponse"):
        assert issubclass(getattr(dsclient, name), dsclient.DSClientError)


def test_the_client_core_never_imports_the_launcher():
    # Dependencies point from the launcher (the server side) to the core, never back; only the
    # command line, which drives both, imports it.
    import ast
    from pathlib import Path

    import dsclient

    root = Path(dsclient.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("cli", "launcher"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{'.' * node.level}{node.module or ''}"]
                names += [f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(".launcher" in n or n.startswith("dsclient.launcher") for n in names):
                offenders.append(path.name)
    assert offenders == []
    assert (root / "launcher" / "__init__.py").exists()
