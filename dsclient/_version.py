"""dsclient's version, in the core so that a module above the client (``dsclient.metrics``
names it to OpenTelemetry) can read it without importing the package's facade,
``dsclient/__init__.py``, which imports every layer. Keep it equal to ``pyproject.toml``'s."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
