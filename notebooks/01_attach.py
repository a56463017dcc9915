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
# # 01 Attach: what the server really runs
#
# Server facts (version, TP, algorithm, hidden-state and metrics flags), the speculative settings SGLang really
# runs next to those requested (SGLang silently overrides some, e.g. `num_draft_tokens`), and a **static wiring
# check**: from the configs alone, the layers SGLang will capture for this draft versus the layers the draft was
# trained on. With `server_url` set this probes that server live (e.g. a TP 8 GPU server); otherwise it shows
# what the replay recorded for each fix.

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
server_url = ""  # live server, e.g. http://gpu-host:30000; empty: the replay's records
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
case = ""  # case file; empty: the one recorded by 00_replay
target_dir = ""  # target folder (config.json); empty: the case's / env/models/target
draft_dir = ""  # draft folder (config.json); empty: the case's / env/models/draft
training_data = ""  # training data; empty: the case's / env/models/data/sample

# %%
from helpers.views import common as R
from helpers.views import attach

R.setup_notebook()
ctx = R.context(run_dir, case=case, server_url=server_url, api_key_env=api_key_env, target_dir=target_dir,
                draft_dir=draft_dir, training_data=training_data, repo_root=repo_root)
R.show(R.run_banner(ctx))
records = [attach.live_attach(ctx)] if ctx.live else attach.attach_records(ctx)
if not records:
    R.show(R.note("Nothing to show: no server_url and no replay in this run folder."))

# %% [markdown]
# ## Per server (one per fix of the replay)

# %%
summary = [attach.show_attach(rec, ctx) for rec in records]
R.write_result(ctx, "01_attach", {"live": ctx.live, "servers": summary})
