# Entry points. `make postmortem` and `make test` are the README's two commands.
PY := .venv/bin/python

.PHONY: setup postmortem test test-all test-fast lab clean-outputs

setup:
	env/setup.sh

postmortem: setup
	$(PY) -m helpers suite run --params env/cases/main.yaml

# the unit tier runs beside the server / notebook tiers, which stay one after the other on one worker
# (tests/conftest.py SERIAL_TIERS); one xdist worker per logical CPU, at most 4
XDIST := -n logical --maxprocesses 4

test: setup
	$(PY) -m pytest -q -rs --durations=25 $(XDIST) -m "not extended"

# everything, the extended tier too (bundled cases whose faults CI already checks live elsewhere)
test-all: setup
	$(PY) -m pytest -q -rs --durations=25 $(XDIST)

test-fast: setup
	$(PY) -m pytest -q -rs $(XDIST) -m "not slow and not extended"

# JupyterLab on 127.0.0.1 with the notebooks listed once (env/jupyter/jupyter_server_config.py); add ARGS=--allow-root
# when running as root (e.g. in a container)
lab: setup
	.venv/bin/jupyter lab --config=env/jupyter/jupyter_server_config.py $(ARGS) notebooks/
