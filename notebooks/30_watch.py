# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 30 Acceptance over time
#
# A live page of `python -m helpers watch --url URL`: the run folder's `watch.jsonl` (one line per sample, read as it
# grows; a torn last line is skipped). Accept length per interval (from the delta of the server's cumulative counters:
# generated tokens / verify steps; else the light probe's; each point says which), the probe's own, the decay
# detector's latest change point with its CI (shaded: where; dashed: the levels before and after, with the effect's
# CI) and the drops it triggered; then KV-cache use, cache hit rate, running requests and the watch's own load on the
# server. Press Refresh (or re-run the cell) while the watch runs. Not part of the postmortem suite: it shows a
# running monitor.

# %% tags=["parameters"]
run_dir = ""  # watch run folder; empty: the newest under outputs/ holding a watch.jsonl
repo_root = ""  # checkout that relative paths are resolved against; empty: this one

# %%
from helpers.views import common as R
from helpers.views import watch

R.setup_notebook()
data = watch.live(run_dir, repo_root=repo_root)
