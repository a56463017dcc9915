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
# # 02 Dump: the aux hidden states the server feeds the draft
#
# A dump holds, for each captured prompt, one row per token of what the draft receives (`served`), what every
# layer of the target computes for the same tokens (`reference`), or what each TP rank holds (`per_rank`,
# captured with SGLang `--forward-hooks`). With `server_url` set, these are the dumps of the live investigation
# (00_investigate, run now if it has not run); otherwise the replay's dumps.

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
server_url = ""  # live server; empty: the replay's dumps
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
case = ""  # case file; empty: the one recorded by 00_replay
target_dir = ""  # empty: the case's / env/models/target
draft_dir = ""  # empty: the case's / env/models/draft
training_data = ""  # empty: the case's / env/models/data/sample
num_samples = 4  # live: training samples to send

# %%
from helpers.views import common as R
from helpers.views import investigation as I
from helpers.views import dump as D

R.setup_notebook()
ctx = R.context(run_dir, case=case, server_url=server_url, api_key_env=api_key_env, target_dir=target_dir,
                draft_dir=draft_dir, training_data=training_data, repo_root=repo_root)
R.show(R.run_banner(ctx))
investigation = I.ensure(ctx, samples=num_samples, draft=draft_dir, target=target_dir,
                         progress=R.StepProgress("investigation")) if ctx.live else None  # live: the dumps 00_investigate captured
H = ctx.hidden_size

# %% [markdown]
# ## Dumps in this run folder

# %%
table = D.dumps_frame(ctx.run_dir, H)
R.show(table if len(table) else R.note("No dump in this run folder."))

# %% [markdown]
# ## Per-chunk row norms of one sample
#
# Each H-wide chunk of a row is one tensor (a layer output, or the embedding). Norms grow with depth in the
# residual stream; an embedding chunk stands out by its small, token-determined norms.

# %%
paths = D.dump_paths(ctx.run_dir)
served = D.served_dumps(ctx.run_dir)
if paths:
    default = served[0] if served else paths[0]
    R.interactive(lambda dump, sample: D.norm_heatmap(dump, sample, H),
                  {"dump": [(str(p.relative_to(ctx.run_dir / "dumps")), p) for p in paths],
                   "sample": [(label, i) for label, i in D.dump_samples(default)]},
                  defaults={"dump": default, "sample": 0}, caption="the first served dump")
    ref = D.reference_dump(ctx.run_dir)
    if ref is not None:
        R.show(D.norm_heatmap(ref, 0, H, title="Reference: every layer of the target for the same tokens"))

# %%
R.write_result(ctx, "02_dump", {"live": ctx.live, "dumps": table.to_dict(orient="records"),
                                        "captured": {"served": str(served[0]) if served else None,
                                                     "reference": str(D.reference_dump(ctx.run_dir) or "") or None}})
