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
# # 20 Acceptance per fix
#
# Accept length (tokens per verify step, bonus included), accept rate (accepted / proposed draft tokens) and
# tok/s per fix, with 95% bootstrap confidence intervals over requests: the live investigation's measurement before
# and after its proposed fix (same prompts on both servers), then the run folder's ledger (`ledger.parquet`: one row
# per measured fix). With `server_url` and `measure_label` set, the live server is measured first and appended to
# the ledger as a new fix.

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
server_url = ""  # live server to measure when measure_label is set; empty: only show the run folder
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
measure_label = ""  # live: the fix name of this measurement (empty: do not measure)
count = 24  # live: prompts (bundled set)
max_new_tokens = 64  # live: tokens per request

# %%
from helpers.plots import acceptance as F
from helpers.views import common as R
from helpers.views import acceptance, postmortem, replay, story
from helpers.views import investigation as I

R.setup_notebook()
ctx = R.context(run_dir, server_url=server_url, api_key_env=api_key_env, repo_root=repo_root)
R.show(R.run_banner(ctx))
if ctx.live and measure_label:
    acceptance.measure_live(ctx, measure_label, count=count, max_new_tokens=max_new_tokens)
ledger = acceptance.ledger_frame(ctx.run_dir)
fixes, sweep = acceptance.measured_fixes(ctx.run_dir, ledger), acceptance.sweep_rows(ledger)
inv = I.load_investigation(ctx.run_dir)

# %% [markdown]
# ## Measured fixes
#
# The ledger's fixes, then the fix's before / after (the paired change over the same prompts, and any figure that
# does not fit the story, flagged with why), then the acceptance budget.

# %%
R.show(acceptance.acceptance_table(fixes) if len(fixes) else R.note("Nothing was measured in this run folder."))
for part in story.measurement_parts(ctx.run_dir, ctx.replay, inv, acceptance.main_fixes(ledger)):
    R.show(part)
for part in acceptance.acceptance_budget(ctx.run_dir, ctx.replay):
    R.show(part)

# %% [markdown]
# ## Accept length and tok/s per fix
#
# Bars: accept length with CI; red markers: tok/s with CI (right axis); dashed: the target-only baseline tok/s
# when the case measured one.

# %%
if len(fixes):
    R.show(F.accept_length_by_fix(fixes))

# %% [markdown]
# ## Per-position acceptance
#
# r_i = P(at least i drafts accepted in a verify step), α_i = r_i / r_(i-1). A broken draft input collapses
# r_1; a good draft decays slowly.

# %%
if len(fixes):
    names = list(dict.fromkeys(fixes["fix"].astype(str)))
    R.interactive(lambda fix: F.position_curves(fixes if fix == "all fixes" else fixes[fixes["fix"].astype(str) == fix],
                                                title=f"Per-position acceptance ({fix})"),
                  {"fix": ["all fixes"] + names})

# %% [markdown]
# ## Tokens per verify step

# %%
if len(fixes):
    R.show(F.accept_length_histogram(fixes))

# %% [markdown]
# ## tok/s vs num_steps
#
# The replay's sweep (its points include the fix's own measurement when the sweep reused it), else the
# ledger's sweep rows.

# %%
fig = replay.sweep_figure(ctx.replay)
if fig is None and len(sweep):
    fig = F.tok_s_vs_steps(sweep)
R.show(fig if fig is not None else R.note("No num_steps sweep in this run folder."))

# %%
R.write_result(ctx, "20_acceptance", {
    "fixes": acceptance.acceptance_table(fixes).to_dict(orient="records"),
    "sweep": acceptance.acceptance_table(sweep).to_dict(orient="records"),
    "before_after": postmortem.before_after(ctx.replay, ledger, run_dir=ctx.run_dir, inv=inv).to_dict(orient="records")})
