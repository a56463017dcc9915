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
# # 11 Hypothesis: Embedding all-reduce
#
# Does VocabParallelEmbedding all-reduce, or does the draft get a rank-local (partial) embedding? This is the seeds' msg 4495. Settled by measurement: each rank's local embedding lookup (zero outside its vocab shard) and the all-reduced output, captured per rank, compared with what the draft is served.
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
NOTEBOOK, CHECK = "11_hyp_embedding_allreduce", "embedding_all_reduce"
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
# ## Per rank: the local embedding before the all-reduce
#
# Each rank looks up only its shard of the vocabulary: rows of tokens outside the shard are zero (dark) before
# the all-reduce. The draft must never see these.

# %%
local = hypotheses.rank_dumps(ctx.run_dir, "embedding_local")
if local:
    R.interactive(lambda rank, sample: dump.norm_heatmap(local[rank], sample, ctx.hidden_size,
                                                      title=f"rank {rank}: local embedding row norms"),
                  {"rank": list(local), "sample": dump.dump_samples(local[min(local)])},
                  caption="rank 0, first forward")
else:
    R.show(R.note("No per-rank capture of the embedding in this run folder."))
