# JupyterLab settings for this repository's notebooks (`make lab`, or
# `.venv/bin/jupyter lab --config=env/jupyter/jupyter_server_config.py notebooks/`).
c = get_config()  # noqa: F821 - provided by Jupyter when it loads this file

# Listen on the loopback interface only: the notebooks attach to servers and read run folders of this machine.
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.open_browser = False

# Each notebook is stored twice, as .ipynb and as its jupytext py:percent twin (notebooks/NN_name.py); jupytext's
# contents manager keeps the pair in sync on save. List the notebook once: hide the twins from the file browser
# (Jupyter's defaults first; `hide_globs` only hides names from listings, the twin is still read and written).
c.ContentsManager.hide_globs = ["__pycache__", "*.pyc", "*.pyo", ".DS_Store", "*~", "[0-9][0-9]_*.py"]
