# Two entry points for a fresh machine that has Python 3.10+; each installs what it needs.
#   make demo  - launch a local vLLM (tiny model) and push a batch through dsclient
#   make test  - lint, type-check, unit tests and integration tests against a real vLLM
PYTHON ?= python3
BOOT := .venv-nox

.PHONY: demo test unit bench clean

$(BOOT)/bin/nox:
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install -q "nox>=2024.4"

demo: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s demo

test: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s lint typecheck tests

unit: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s unit

bench: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s bench

clean:
	rm -rf $(BOOT) .nox .mypy_cache .ruff_cache .pytest_cache
