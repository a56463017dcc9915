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
# # 12 Hypothesis: Layer offset
#
# Is every aux chunk one (or k) layer(s) away from the layer the draft was trained on (a layer-id convention mismatch: SGLang adds +1 to explicit ids, vLLM / speculators do not)? Settled by measurement: every served chunk is identified against every layer of the target for the same tokens (reference capture).
#
# The verdict is about the hypothesis of a fault: **confirmed** (the fault is there), **refuted** (measured and
# absent), **inconclusive** (the data cannot decide; the explanation says what is missing). Without
# `server_url` this shows what the replay recorded for this check; with it, the verdict of the live
# investigation (00_investigate) of that server.

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
server_url = ""  # live server; empty: the replay's recorded result
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
case = ""  # case file; empty: the one recorded by 00_replay
target_dir = ""  # empty: the case's / env/models/target
draft_dir = ""  # empty: the case's / env/models/draft
training_data = ""  # empty: the case's / env/models/data/sample

# %%
from helpers.views import common as R
from helpers.views import investigation as I
from helpers.views import hypotheses, replay

R.setup_notebook()
NOTEBOOK, CHECK = "12_hyp_layer_offset", "layer_offset"
ctx = R.context(run_dir, case=case, server_url=server_url, api_key_env=api_key_env, target_dir=target_dir,
                draft_dir=draft_dir, training_data=training_data, repo_root=repo_root)
R.show(R.run_banner(ctx))
if ctx.live:
    steps, source = I.hypothesis_steps(I.ensure(ctx, draft=draft_dir, target=target_dir, progress=R.StepProgress("investigation")), CHECK), "live investigation"
else:
    steps, source = replay.hypothesis_steps(ctx.replay, CHECK), "replay"

# %% [markdown]
# ## Verdict, explanation, evidence

# %%
for step in steps:
    replay.show_hypothesis(step, ctx.run_dir)
if not steps:
    R.show(R.note(f"The replay in this run folder has no '{CHECK}' step, and no server_url was given."))
R.write_result(ctx, NOTEBOOK, hypotheses.hypothesis_result(NOTEBOOK, CHECK, steps, source))

# %% [markdown]
# ## Which layer is each chunk?
#
# From 03_compare (results/03_compare.json): each served chunk against every layer of the target for the
# same tokens. The red bar is the layer the chunk really holds.

# %%
import pandas as pd

compared = R.read_result(ctx.run_dir, "03_compare") or {}
ref = pd.DataFrame(compared.get("reference_rel_diff") or {})
if len(ref):
    R.interactive(lambda chunk: hypotheses.reference_bars(ref, chunk), {"chunk": list(range(len(ref)))},
                  caption="chunk 0")
else:
    R.show(R.note("No reference comparison in this run folder (03_compare did not run or had no reference)."))
