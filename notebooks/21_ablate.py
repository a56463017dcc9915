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
# # 21 Ablations and workload sweeps
#
# What the workload and the engine cost in acceptance, each measured with a paired 95% CI over the same prompts:
# accept length, accept rate and tok/s against the context length (prompt + generated tokens), the sampling
# temperature and the number of requests in flight on the running server; then engine features that public reports
# blame (radix cache, chunked prefill, overlap scheduler, CUDA graphs, attention / sampling backend, spec v1, the
# draft itself), each turned off on a restarted copy of the server. A fall that its CI supports is a finding: its
# cause is `workload` (the requests, not the server) or `engine`. A toggle that does not apply to the server's
# version or device is listed with the reason, not measured.
#
# Without `server_url` this shows the run folder's `results/ablate.json` (from `python -m helpers ablate` or the
# investigation's sweep step); with it, the sweeps run against that server into the run folder (once: a run folder
# that holds results is never overwritten).

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
server_url = ""  # live server to sweep; empty: show the run folder's results
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
api_key_env = "SGLANG_API_KEY"  # NAME of the environment variable holding the API key (never the key)
sweeps = "context,temperature,concurrency"  # live: the sweeps, in order (or "none")
toggles = "none"  # live: engine toggles on a restarted copy ("none", or e.g. "radix_cache_off,draft_off")
budget_s = 120  # live: seconds for everything; what does not fit is skipped and listed
num_prompts = 10  # live: prompts per point
max_new_tokens = 32  # live: tokens per request
temperature = 1.0  # live: your requests' temperature, measured against 0

# %%
from helpers.views import ablate
from helpers.views import common as R

R.setup_notebook()
ctx = R.context(run_dir, server_url=server_url, api_key_env=api_key_env, repo_root=repo_root, create=bool(server_url),
                name="ablate")
R.show(R.run_banner(ctx))
doc = ablate.load_ablation(ctx.run_dir)
if ctx.live and doc is None:
    doc = ablate.run_live(ctx, sweeps=[s for s in sweeps.split(",") if s.strip() and s != "none"],
                          toggles=[t for t in toggles.split(",") if t.strip() and t != "none"], budget_s=budget_s,
                          num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature)

# %% [markdown]
# ## Findings, sweeps and toggles
#
# Each sweep: accept length with its 95% CI per point (tok/s on the right axis; for the context sweep, the draft
# config's `max_position_embeddings` and the mean training sample as dashed lines), then the table with the paired
# change of each point against the sweep's reference point (the prompts as given, temperature 0, one request in
# flight).

# %%
for part in ablate.ablation_parts(doc):
    R.show(part)
