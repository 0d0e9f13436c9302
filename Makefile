# Two entry points for a fresh machine that has Python 3.10+; each installs what it needs.
#   make demo  - launch a local vLLM (tiny model) and push a batch through dsclient
#   make test  - lint, type-check, the docs site, unit tests and integration tests against a
#                real vLLM
PYTHON ?= python3
BOOT := .venv-nox

.PHONY: demo test unit bench docs clean

$(BOOT)/bin/nox:
	$(PYTHON) -m venv $(BOOT)
	$(BOOT)/bin/pip install -q "nox>=2024.4"

demo: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s demo

test: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s lint typecheck docs tests

unit: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s unit

bench: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s bench

docs: $(BOOT)/bin/nox
	$(BOOT)/bin/nox -s docs

clean:
	rm -rf $(BOOT) .nox .mypy_cache .ruff_cache .pytest_cache site
