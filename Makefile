# Entry points. `make postmortem` and `make test` are the README's two commands.
PY := .venv/bin/python

.PHONY: setup postmortem test test-fast lab clean-outputs

setup:
	env/setup.sh

postmortem: setup
	$(PY) -m helpers suite run --params env/cases/main.yaml

test: setup
	$(PY) -m pytest -q -rs --durations=25

test-fast: setup
	$(PY) -m pytest -q -rs -m "not slow"

# JupyterLab on 127.0.0.1 with the notebooks listed once (env/jupyter/jupyter_server_config.py); add ARGS=--allow-root
# when running as root (e.g. in a container)
lab: setup
	.venv/bin/jupyter lab --config=env/jupyter/jupyter_server_config.py $(ARGS) notebooks/
