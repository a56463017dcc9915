# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Postmortem

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
recorded_cases = []  # recorded case files shown after the run's own case, replayed offline (no server started)

# %%
from helpers.plots import acceptance as F
from helpers.views import common as R
from helpers.views import acceptance, postmortem, replay, story
from helpers.views import investigation as I
from helpers.views.recorded import recorded_parts

R.setup_notebook()
ctx = R.context(run_dir, repo_root=repo_root)
R.show(R.run_banner(ctx))
doc, ledger, status = ctx.replay, acceptance.ledger_frame(ctx.run_dir), postmortem.suite_status(ctx.run_dir)
inv = I.load_investigation(ctx.run_dir)
for part in story.first_screen(ctx.run_dir, doc, inv, acceptance.main_fixes(ledger)):
    R.show(part)

# %% [markdown]
# ## The blind investigation
#
# What the tool found on its own: findings, the hypotheses ordered by evidence, the proposed fix, its measurement
# and the acceptance budget's details (the ladder is on the first screen above).

# %%
for part in (I.sections_html(inv, with_headline=False, replay=doc, ladder=False) if inv is not None else
             [R.note("No live investigation in this run folder.")]):
    R.show(part)

# %% [markdown]
# ## Recorded cases, replayed offline
#
# Cases recorded once on a live server with a fault (the params' `recorded_cases`, e.g. the Kimi-class target's own
# MTP / NextN head fed the token embedding, `env/cases/mtp_embedding.yaml`) and read back here from their recordings: no
# server is started for them. Each shows what the tool named blind on that server, and what it cost.

# %%
for case_file in recorded_cases:
    for part in recorded_parts(case_file, repo_root or None):
        R.show(part)
if not recorded_cases:
    R.show(R.note("No recorded case in this run's params."))

# %% [markdown]
# ## Verdicts
#
# Every hypothesis, in the order of the investigation, with the verdict the case expected. Where the replay and the blind investigation disagree on a check, a note under the table says why.

# %%
R.show(postmortem.verdicts_html(ctx.run_dir, doc))
compared = R.read_result(ctx.run_dir, "03_compare") or {}
if compared.get("findings"):
    R.show("<b>Offline diagnosis (03_compare) findings</b>")
    R.show(R.findings_frame(compared.get("findings")))

# %% [markdown]
# ## Acceptance per fix
#
# Every fix of the run along the timeline (the before / after of the fix is on the first screen above).

# %%
R.show(replay.timeline_figure(doc))
fixes = acceptance.main_fixes(ledger)
if len(fixes):
    R.show(F.accept_length_by_fix(fixes))
fig = replay.sweep_figure(doc)
if fig is not None:
    R.show(fig)

# %% [markdown]
# ## Notebooks of this run
#
# Each step of the investigation as its own page (code hidden; "Show code" at the top right).

# %%
R.show(postmortem.notebook_links_html(status))
R.show("<b>Failures</b>")
R.show(postmortem.failures_html(status))
R.write_result(ctx, "99_postmortem", postmortem.postmortem_record(ctx.run_dir, doc))
