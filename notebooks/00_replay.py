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
# # 00 Replay: the investigation as a timeline
#
# A case file tells an investigation as a timeline: **fixes** (server configurations, after each of which
# acceptance is measured) and **hypotheses** (named checks that return a verdict from measurements, not from
# reading engine code), optionally a `num_steps` **sweep**. This notebook replays the case on the embedded
# SGLang reference server (a fresh server per fix) and renders the timeline. The other notebooks of the suite
# are views of what this replay records in the run folder.

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: a new one under outputs/
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding an API key (never the key)
case = ""  # the case file to replay (empty: only show a replay already in run_dir)

# %%
from helpers.views import common as R
from helpers.views import investigation as I
from helpers.views import replay

R.setup_notebook()
ctx = R.context(run_dir, case=case, api_key_env=api_key_env, repo_root=repo_root, create=bool(case))
R.show(R.run_banner(ctx))
doc = replay.run_or_load_replay(ctx)

# %% [markdown]
# ## What was wrong

# %%
R.show(replay.headline_html(doc, I.load_investigation(ctx.run_dir)))
R.show(replay.story_html(doc))

# %% [markdown]
# ## Accept rate per fix, with the hypotheses on the timeline
#
# Points: accept rate of each fix (95% bootstrap CI over requests; diamonds: accept length, right axis).
# Dashed vertical lines: hypotheses, coloured by verdict (red confirmed, green refuted, grey inconclusive).

# %%
R.show(replay.timeline_figure(doc))
R.show(replay.fixes_display(doc))

# %% [markdown]
# ## Verdicts

# %%
R.show(replay.hypotheses_frame(doc))

# %% [markdown]
# ## Step by step
#
# Each hypothesis with its question, verdict, the verdict the case expected, a plain-words explanation, the
# evidence table and its figure.

# %%
replay.show_timeline(doc, ctx.run_dir)

# %% [markdown]
# ## Sweep: tok/s vs num_steps
#
# Once acceptance is right, the number of draft steps trades acceptance against verify cost.

# %%
fig = replay.sweep_figure(doc)
R.show(fig if fig is not None else R.note("This case has no num_steps sweep."))
