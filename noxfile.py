"""Developer tasks. ``make demo`` / ``make test`` call these; ``nox -l`` lists them.

The reference vLLM server lives in its own virtualenv (see ``dsclient install-server``), made once
per machine and shared by every session here, so ``tests`` and ``demo`` never install it twice.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["lint", "typecheck", "docs", "tests"]
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _install_server(session: nox.Session) -> None:
    # Idempotent: does nothing when the server venv already has the right vLLM.
    session.run("dsclient", "install-server")


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests, then integration tests against a real vLLM started by dsclient's launcher."""
    session.install("-e", ".[test]")
    _install_server(session)
    args = session.posargs or ["-m", "not integration", "-q"]
    session.run("pytest", *args)
    if not session.posargs:
        # llama-cpp-python, a black box of the integration tests, is built from source (cmake),
        # once a machine; here rather than in the first test that uses it.
        session.run("python", "-m", "tests.integration.blackbox", "build-llama-cpp")
        session.run("pytest", "-m", "integration", "-v", "--timeout=1200")


@nox.session
def unit(session: nox.Session) -> None:
    """The fast unit tests only (seconds; no server)."""
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "not integration", "-q", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "dsclient", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "dsclient")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over the package."""
    session.install("-e", ".", "mypy>=1.11")
    session.run("mypy", "--strict", "dsclient")


@nox.session
def docs(session: nox.Session) -> None:
    """The docs site (mkdocs-material; API reference from the docstrings), built --strict."""
    # ruff formats the rendered signatures; the banner about MkDocs 2 is noise in CI logs.
    # Output in site/ (gitignored).
    session.install("-e", ".[docs]", "ruff>=0.6")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: launch a local vLLM with the tiny model and push a batch through dsclient."""
    session.install("-e", ".")
    _install_server(session)
    session.run("python", "examples/batch_demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (on demand): results to benchmarks/results/, summary in docs/benchmarks.md."""
    session.install("-e", ".[bench]")  # matplotlib, and LiteLLM for the headline comparison
    _install_server(session)
    session.run("python", "-m", "benchmarks", *session.posargs)
