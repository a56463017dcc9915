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
# # 00 Investigate: what is wrong with this server?
#
# The live investigation, blind: attach to the server (what it really runs: draft, target, algorithm, hooks),
# capture what it feeds the draft for the training data's tokens, compare with the training data and every layer of
# the target (the server's own every-layer capture when its hooks are on, else HF), name the fault, order the
# hypotheses by evidence and propose the fix. When the server can be restarted by the tool (an embedded server, or
# `relaunch` given), the fix is applied on a fresh server and measured before / after on the same prompts.
# Without a live server this page shows the investigation the replay recorded (`investigation.json`).

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: a new one under outputs/ (live), the newest one (no server_url)
server_url = ""  # the live server; empty: show the recorded investigation
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
target_dir = ""  # the target folder, when the server's model_path is not readable here
draft_dir = ""  # the draft folder, when the server's is not readable here (a different one is a finding)
training_data = ""  # the draft's training data (empty: env/models/data/sample)
samples = 4  # training samples to capture and compare
apply_fix = True  # restart the server with the proposed fix and measure before / after (when it can be restarted)
relaunch = ""  # the server's launch command, for servers the tool did not start
fixed_port = ""  # port or LOW-HIGH range of the fixed server (empty: a free port of $E3F_PORT_RANGE, else 12000-19999)
timeout = 900  # overall budget in seconds
prompts = 16  # prompts of the before / after measurement
acceptance_budget = True  # run the draft offline on the training, served and live states: where the accept length goes

# %%
from helpers.views import common as R
from helpers.views import investigation as I

R.setup_notebook()
ctx = R.context(run_dir, server_url=server_url, api_key_env=api_key_env, target_dir=target_dir, draft_dir=draft_dir,
                training_data=training_data, repo_root=repo_root, create=bool(server_url))
R.show(R.run_banner(ctx))
doc = I.ensure(ctx, samples=samples, apply_fix=apply_fix, relaunch=relaunch, timeout=timeout, prompts=prompts,
               draft=draft_dir, target=target_dir, port=fixed_port, acceptance_budget=acceptance_budget,
               progress=R.StepProgress("investigation") if ctx.live else None)

# %% [markdown]
# ## The investigation

# %%
for part in (I.sections_html(doc, replay=ctx.replay, run_dir=ctx.run_dir) if doc is not None else
             [R.note("No live server and no investigation.json in this run folder.")]):
    R.show(part)

# %% [markdown]
# ## Where things are

# %%
R.show(I.where_html(ctx.run_dir, doc, I.reproduce_command(ctx, samples=samples, prompts=prompts, timeout=timeout,
                                                          apply_fix=apply_fix, relaunch=relaunch, draft=draft_dir,
                                                          target=target_dir, port=fixed_port) if ctx.live else ""))
