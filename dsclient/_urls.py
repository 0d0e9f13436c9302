"""Server URLs: one rule for the root URL a client talks to, and one for a URL in logs and labels.

    >>> root_url(" HTTP://GPU-Box:8000/v1/ ")
    'http://gpu-box:8000'
    >>> url_label("https://user:secret@example.org/v1?key=abc")
    'https://example.org'

The rule (:func:`root_url`), for every place that takes a server URL (the client, discovery, the
launch records, the metrics):

====================================  ==========================================================
whitespace around it                   stripped
trailing ``/`` and ``/v1``             dropped: ``http://h:8000/v1/`` is ``http://h:8000``
scheme                                 ``http`` or ``https``, any case, written lower case
host                                   required; written lower case (host names are not case
                                       sensitive, so one server is one string: one pool entry,
                                       one metrics series); an IDN host in its ASCII form
port                                   kept, except the scheme's default (``:80`` for http,
                                       ``:443`` for https), which is dropped, as httpx does
user info (``user:password@``)         kept: it is how a URL carries basic auth, which httpx
                                       sends. A root URL may therefore hold a secret: log and
                                       label with :func:`url_label`, never the root URL itself
a path before ``/v1``                  kept (a server behind a prefix: ``http://h/llm``)
query or fragment                      refused (``ValueError``): requests are built by appending
                                       paths to the root, which a query would swallow
====================================  ==========================================================

Errors show the URL as :func:`url_label` writes it, so a password in a bad URL is not repeated
in a traceback or a log. Launch records key servers by a stricter form of this rule
(:func:`dsclient._records.normalize_url`: every loopback spelling is one host, the port always
written).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ._http import httpx

__all__ = ["root_url", "url_label"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


def _invalid(url: object) -> ValueError:
    # The URL in the message goes through the label: a password in it must not reach a log.
    return ValueError(
        f"base_url must be an http(s) URL like 'http://127.0.0.1:8000', got {_stripped(url)!r}"
    )


def root_url(url: str) -> str:
    """The server's root URL under the rule above; ``ValueError`` / ``TypeError`` when it is none.

        root_url("http://127.0.0.1:8000/v1/")   # 'http://127.0.0.1:8000'
        root_url("https://Example.org:443")     # 'https://example.org'
        root_url("127.0.0.1:8000")              # ValueError: no scheme

    Parameters:
        url: an ``http://`` or ``https://`` URL of a server, with or without ``/v1``.
    """
    if not isinstance(url, str):
        raise TypeError(f"base_url must be a str or a launched Server, got {type(url).__name__}")
    text = url.strip()
    if "://" not in text:
        raise _invalid(url)
    try:
        parsed = httpx.URL(text)
    except httpx.InvalidURL:
        raise _invalid(url) from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise _invalid(url)
    if b"?" in parsed.raw_path or "#" in text.partition("://")[2].rpartition("@")[2]:
        raise ValueError(
            "base_url must be a server's root URL without a query or fragment, "
            f"got {_stripped(url)!r}"
        )
    # httpx has lower-cased the scheme and host and IDNA-encoded the host; the URL is written
    # back by hand, since str() keeps a default port when the scheme was upper case.
    host = parsed.raw_host.decode("ascii")
    host = f"[{host}]" if ":" in host else host
    port = parsed.port
    port_part = "" if port is None or port == _DEFAULT_PORTS[parsed.scheme] else f":{port}"
    userinfo = parsed.userinfo.decode("ascii")
    user_part = f"{userinfo}@" if userinfo else ""
    path = parsed.raw_path.decode("ascii")
    root = f"{parsed.scheme}://{user_part}{host}{port_part}{path}".rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")].rstrip("/")
    return root


def url_label(url: str) -> str:
    """``url`` without user info, query or fragment: safe in logs and metrics labels.

        url_label("http://user:pw@h:8000/v1?token=x")   # 'http://h:8000'

    A valid server URL gets the root URL rule (so a label and :func:`root_url` agree); anything
    else is cut to its scheme, host and path, so a bad URL in an error message leaks nothing.
    """
    try:
        root = root_url(url)
    except (TypeError, ValueError):
        return _stripped(url)
    scheme, _, rest = root.partition("://")
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}"


def _stripped(url: object) -> str:
    text = url.strip() if isinstance(url, str) else repr(url)
    try:
        parts = urlsplit(text)
        host = parts.netloc.rpartition("@")[2]
    except ValueError:
        return "<unparseable URL>"
    if not parts.scheme or not host:
        # No authority: only the path part can be shown, and a secret may be anywhere in it.
        return "<unparseable URL>" if "@" in text or "?" in text else text.split("#")[0]
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{host}{path}"
