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
# # 10 Hypothesis: TP sharding
#
# Are the captured aux hidden states full width and identical on every TP rank, or H/tp-wide shards / per-rank partial values? This is the seeds' msg 4513 ("concat order and TP width") and msg 4525 ("are the captured states full 7168 or 896-wide shards?"). Settled by measurement: the served row width against H and H/tp, and (with per-rank capture through `--forward-hooks`) the aux states of every rank compared with rank 0's.
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
from helpers.views import dump, hypotheses, replay

R.setup_notebook()
NOTEBOOK, CHECK = "10_hyp_tp_sharding", "tp_sharding"
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
# ## Per rank: does every rank hold the same aux states?
#
# With per-rank capture, the difference between each rank's aux states and rank 0's, token by token. All zero:
# the residual stream is all-reduced before capture (standard tensor parallelism), nothing is sharded.

# %%
ranks = hypotheses.rank_dumps(ctx.run_dir, "aux")
if len(ranks) > 1:
    R.interactive(lambda rank, sample: hypotheses.rank_diff_figure(ranks, rank, ctx.hidden_size, sample=sample),
                  {"rank": [r for r in ranks if r != 0], "sample": dump.dump_samples(ranks[0])},
                  caption="rank 1 vs rank 0, first forward")
else:
    R.show(R.note("No per-rank capture of the aux states in this run folder (TP 1, or no --forward-hooks)."))
