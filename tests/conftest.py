"""Shared fixtures: the anyio backend, and ONE real vLLM server for all integration tests.

``vllm_server`` is session-scoped and starts only when an ``integration``-marked test asks for
it: the tiny random model (built once, cached in ``~/.cache/dsclient/models/tiny-llama``) served
by vLLM through dsclient's own launcher with ``max_num_seqs=8``, ``max_model_len=2048`` and the
served name ``"tiny"``. It fails (never skips) when the server venv is missing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsclient.launcher import LaunchError, Server, launch, make_tiny_model, resolve_server_python
from tests.redis_server import RedisServer

#: What the shared server is started with; integration tests may rely on these numbers.
VLLM_MAX_NUM_SEQS = 8
VLLM_MAX_MODEL_LEN = 2048
VLLM_MODEL_NAME = "tiny"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _private_launch_records(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[None]:
    """Unit tests read and write launch records in a folder of their own: a real server on
    127.0.0.1:8000 (where ``dsclient serve`` goes by default) must not leak its record into a
    test's fake server at the same URL. Integration tests use the real folder."""
    if request.node.get_closest_marker("integration") is not None:
        yield
        return
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("DSCLIENT_STATE_DIR", str(tmp_path_factory.mktemp("launch-records")))
    try:
        yield
    finally:
        monkeypatch.undo()


def _progress(message: str) -> None:
    # Shown even under pytest's capture: a minute of silence looks like a hang.
    print(f"[vllm_server] {message}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="session")
def _vllm_server_session() -> Iterator[Server]:
    try:
        install = resolve_server_python()
    except LaunchError as exc:
        pytest.fail(
            f"the integration tests need the vLLM server venv: {exc}\n"
            "Run 'dsclient install-server' (or 'nox -s tests', which does it).",
            pytrace=False,
        )
    _progress(f"using {install.dist} {install.version} from {install.python}")
    model = make_tiny_model(python=install.python)
    server = launch(
        model,
        python=install.python,
        max_num_seqs=VLLM_MAX_NUM_SEQS,
        max_model_len=VLLM_MAX_MODEL_LEN,
        served_model_name=VLLM_MODEL_NAME,
        dtype="float32",
        progress=_progress,
    )
    with server:
        yield server


#: The plain server: what a user might start by hand, with vLLM's admission control on.
PLAIN_MAX_NUM_SEQS = 12  # not the default guess of 8: learning it must show
PLAIN_MAX_NUM_QUEUED_REQS = 32  # room for a queue the gauges can show


@pytest.fixture(scope="session")
def plain_vllm_server() -> Iterator[str]:
    """A real vLLM started by hand (not by dsclient's launcher): no launch record, no dev mode,
    ``--max-num-seqs 12 --max-num-queued-reqs 32``. Yields its URL. Integration tests only."""
    from tests.integration.plain_vllm import plain_vllm

    try:
        install = resolve_server_python()
    except LaunchError as exc:
        pytest.fail(f"the integration tests need the vLLM server venv: {exc}", pytrace=False)
    model = make_tiny_model(python=install.python)
    _progress("starting a plain vLLM (not through the launcher) ...")
    args = [
        "--max-num-seqs",
        str(PLAIN_MAX_NUM_SEQS),
        "--max-num-queued-reqs",
        str(PLAIN_MAX_NUM_QUEUED_REQS),
        "--max-model-len",
        "2048",
    ]
    with plain_vllm(install.python, str(model), args) as url:
        _progress(f"plain vLLM at {url}")
        yield url


@pytest.fixture
def vllm_server(request: pytest.FixtureRequest) -> Server:
    """The shared real vLLM server (a :class:`dsclient.launcher.Server`); integration tests only.

    ``vllm_server.url``, ``.model`` (``"tiny"``), ``.max_num_seqs`` (8), ``.max_model_len`` (2048).
    """
    if request.node.get_closest_marker("integration") is None:
        pytest.fail("vllm_server is for tests marked @pytest.mark.integration", pytrace=False)
    server = request.getfixturevalue("_vllm_server_session")
    assert isinstance(server, Server)
    return server


# --- Redis: a real redis-server on a free loopback port (tests/redis_server.py) -------------------


@pytest.fixture(scope="session")
def _redis_session() -> Iterator[RedisServer]:
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


def _flushall(port: int) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"FLUSHALL\r\n")
        if not sock.recv(64).startswith(b"+OK"):
            raise RuntimeError("FLUSHALL failed on the test redis-server")


@pytest.fixture
def redis_url(_redis_session: RedisServer) -> str:
    """The URL (``redis://127.0.0.1:PORT/0``) of one real redis-server shared by the session,
    emptied (FLUSHALL) before each test. Tests that stop or kill Redis use ``redis_server``."""
    _redis_session.start()  # no-op unless a test stopped it
    _flushall(_redis_session.port)
    return _redis_session.url


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private real redis-server for one test, free to ``stop()`` / ``kill()`` / ``start()``
    (same port) mid-test; stopped at the end. ``redis_server.url`` is its URL."""
    try:
        server = RedisServer()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with server:
        yield server


# --- Servers that publish nothing (tests/integration/blackbox.py) --------------------------------


def _serve(server: contextlib.AbstractContextManager[str]) -> Iterator[str]:
    """Enter a server's context manager; a server that cannot start fails the test (no skip)."""
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(server)
        except RuntimeError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield url


@pytest.fixture(scope="session")
def nginx_vllm(_vllm_server_session: Server) -> Iterator[str]:
    """The shared vLLM behind nginx passing only ``/v1/*`` (no /metrics, /tokenize, /health, and
    no launch record at the gateway's URL). Yields the gateway's URL. Integration tests only."""
    from tests.integration.blackbox import nginx_gateway

    yield from _serve(nginx_gateway(_vllm_server_session.url))


def _transformers_python() -> str:
    try:
        return str(resolve_server_python().python)
    except LaunchError as exc:
        pytest.fail(f"transformers serve runs from the vLLM server venv: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def transformers_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, without an end-of-sequence token (answers are max_tokens long)."""
    from tests.integration.blackbox import model_without_eos

    tiny = make_tiny_model(python=_transformers_python())
    return model_without_eos(tiny, tmp_path_factory.mktemp("tiny-no-eos"))


@pytest.fixture(scope="session")
def llama_cpp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-cpp-python's server on the tiny model, converted to GGUF by llama.cpp's converter
    (the package is built once a machine: ``.ci/run`` builds it first). Yields its URL."""
    from tests.integration.blackbox import ensure_llama_cpp, llama_cpp_server, tiny_gguf

    converter = _transformers_python()  # the vLLM venv: torch, transformers, numpy
    try:
        python = ensure_llama_cpp()
        tiny = make_tiny_model(python=converter)
        gguf = tiny_gguf(tiny, tmp_path_factory.mktemp("gguf") / "tiny.gguf", converter)
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield from _serve(llama_cpp_server(python, gguf))


@pytest.fixture(scope="session")
def transformers_server(
    transformers_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """transformers' own server (``transformers serve --continuous-batching``, CPU) listing the
    tiny model as ``"local/m"`` from a private Hugging Face cache; other models (a folder's path)
    it loads on demand without listing them. Yields its URL."""
    from tests.integration.blackbox import hub_cache, transformers_server

    home = tmp_path_factory.mktemp("hf-home")
    hub_cache(transformers_model, home / "hub")
    yield from _serve(transformers_server(_transformers_python(), hf_home=home))
