"""dsclient._urls: the one rule for a server's root URL, and the label that is safe to log."""

from __future__ import annotations

import pytest

from dsclient._http import httpx
from dsclient._records import normalize_url
from dsclient._urls import root_url, url_label
from dsclient.client._discovery import discover


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("given", "root"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("  http://127.0.0.1:8000/v1/ \n", "http://127.0.0.1:8000"),
        # Case: scheme and host are written lower case, the path as given.
        ("HTTP://GPU-Box:8000/V1", "http://gpu-box:8000/V1"),
        ("https://Example.ORG/llm/v1", "https://example.org/llm"),
        # Default ports are dropped; others kept.
        ("http://h:80", "http://h"),
        ("HTTPS://h:443", "https://h"),  # str(httpx.URL(...)) keeps this port; the rule drops it
        ("https://h:443/v1", "https://h"),
        ("https://h:80", "https://h:80"),
        ("http://h:443", "http://h:443"),
        # User info is kept (basic auth rides on it).
        ("http://user:pa%40ss@h:8000/v1", "http://user:pa%40ss@h:8000"),
        ("http://[::1]:8123/v1", "http://[::1]:8123"),
        ("http://bücher.example/v1", "http://xn--bcher-kva.example"),
        # A path before /v1 stays (a server behind a prefix).
        ("http://h/prefix/v1/", "http://h/prefix"),
    ],
)
def test_root_url_rule(given: str, root: str) -> None:
    assert root_url(given) == root
    assert root_url(root) == root  # idempotent


@pytest.mark.parametrize(
    "bad", ["127.0.0.1:8000", "ftp://h", "http://", "http://:8000", "http://h:port", ""]
)
def test_root_url_refuses_what_is_no_http_url(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^base_url must be an http\(s\) URL like "):
        root_url(bad)


def test_root_url_error_texts_are_the_clients() -> None:
    with pytest.raises(
        ValueError,
        match=r"^base_url must be an http\(s\) URL like 'http://127.0.0.1:8000', got 'ftp://h'$",
    ):
        root_url("ftp://h")
    with pytest.raises(TypeError, match="^base_url must be a str or a launched Server, got int$"):
        root_url(8000)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["http://h:8000?x=1", "http://h:8000/v1?", "http://h/#top"])
def test_root_url_refuses_a_query_or_fragment(bad: str) -> None:
    with pytest.raises(ValueError, match="without a query or fragment"):
        root_url(bad)


@pytest.mark.parametrize(
    "bad", ["ftp://user:hunter2@h", "http://user:hunter2@h:8000/v1?token=hunter2", "user:hunter2@h"]
)
def test_root_url_errors_never_repeat_a_secret(bad: str) -> None:
    with pytest.raises(ValueError) as caught:
        root_url(bad)
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("given", "label"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://user:secret@H:8000/v1/", "http://h:8000"),
        ("https://token@example.org:443/llm/v1", "https://example.org/llm"),
        ("https://user:secret@example.org/v1?key=secret#frag", "https://example.org"),
        ("ftp://user:secret@h/path?key=secret", "ftp://h/path"),
        ("user:secret@h:8000/x?key=secret", "<unparseable URL>"),
        ("h:8000", "h:8000"),
    ],
)
def test_url_label_carries_no_secret(given: str, label: str) -> None:
    assert url_label(given) == label
    assert "secret" not in url_label(given)


def test_url_label_of_a_root_url_is_the_root_url_without_user_info() -> None:
    for url in ("http://127.0.0.1:8000", "https://h:8443/prefix", "http://[::1]:1"):
        assert url_label(url) == root_url(url)


def test_records_key_is_the_root_url_made_stricter() -> None:
    # The stricter record key (loopback names, explicit port, no user info) on top of root_url.
    assert normalize_url("HTTP://u:p@LOCALHOST:8123/v1/") == "http://127.0.0.1:8123"
    assert normalize_url(" https://Example.org/v1 ") == "https://example.org:443"
    assert normalize_url("127.0.0.1:8123") == "http://127.0.0.1:8123"  # no scheme: http
    with pytest.raises(ValueError, match="http"):
        normalize_url("ftp://h")


@pytest.mark.anyio
async def test_discovery_takes_the_same_rule() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "owned_by": "vllm"}]})
        return httpx.Response(404)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
        info = await discover(http, " HTTP://Box:80/v1/ ", records=None)
        with pytest.raises(ValueError, match=r"http\(s\) URL"):
            await discover(http, "box:8000", records=None)
    assert info.url == "http://box"
    assert seen and all(url.startswith("http://box/") for url in seen)
