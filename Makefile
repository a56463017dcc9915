# Entry points. `make postmortem` and `make test` are the README's two commands.
PY := .venv/bin/python

.PHONY: setup postmortem test test-fast clean-outputs

setup:
	env/setup.sh

postmortem: setup
	$(PY) -m helpers suite run --params env/cases/main.yaml

test: setup
	$(PY) -m pytest -q -rs

test-fast: setup
	$(PY) -m pytest -q -rs -m "not slow"
