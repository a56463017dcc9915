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
# # 03 Compare: served vs training, chunk by chunk
#
# Rows are aligned by token ids; every served chunk is compared with every training chunk
# (`rel_diff = 1 - 2<x,y>/(|x|^2+|y|^2)`, 0 = identical) and, with the reference dump, with every layer of the
# target, which names what each chunk really holds. The findings name the fault in the shared vocabulary
# (`embedding_in_place_of_layer`, `layer_offset`, `tp_partial_sum`, ...).

# %% tags=["parameters"]
run_dir = ""  # run folder; empty: the newest under outputs/
repo_root = ""  # checkout that relative paths are resolved against; empty: this one
case = ""  # case file; empty: the one recorded by 00_replay
target_dir = ""  # empty: the case's / env/models/target
draft_dir = ""  # empty: the case's / env/models/draft
training_data = ""  # empty: the case's / env/models/data/sample
served = ""  # served dump folder; empty: the first served dump of the run folder
max_samples = 8  # training samples read

# %%
from helpers.views import common as R
from helpers.views import compare, dump

R.setup_notebook()
ctx = R.context(run_dir, case=case, target_dir=target_dir, draft_dir=draft_dir, training_data=training_data,
                repo_root=repo_root)
R.show(R.run_banner(ctx))
candidates = dump.served_dumps(ctx.run_dir)
served_dump = R.as_path(served) or (candidates[0] if candidates else None)
if served_dump is None:
    raise FileNotFoundError(f"no served dump in {ctx.run_dir}/dumps (run 00_replay or 02_dump first)")
H = ctx.hidden_size
diag = compare.run_diagnosis(ctx, served_dump, reference=dump.reference_dump(ctx.run_dir), max_samples=max_samples)
tol = diag.comparison.tolerance
draft, draft_from = compare.draft_for_dump(ctx, served_dump)
R.show(R.note(f"served dump: {served_dump}; judged against the draft config in {draft} (from {draft_from}); training "
              f"data: {ctx.training}; tolerance {tol:g}" + "".join(f"; note: {n}" for n in diag.notes)))

# %% [markdown]
# ## Findings

# %%
R.show(R.findings_frame(diag.findings) if diag.findings else R.note("No finding: served equals training."))

# %% [markdown]
# ## Chunk table
#
# Per served chunk: the tensor the config asks for, the tensor training used, the tensor the reference says it
# holds, the closest training chunk and its rel_diff / cosine.

# %%
R.show(compare.chunk_table(diag))

# %% [markdown]
# ## Served x training rel_diff
#
# Diagonal blue = each slot holds what the draft was trained on. A red diagonal cell is a slot the draft reads
# wrong features from.

# %%
matrix = compare.rel_diff_matrix(diag)
R.show(compare.rel_diff_heatmap(matrix, title="rel_diff: served chunk x training chunk", tolerance=tol))
ref_matrix = compare.rel_diff_matrix(diag, against="reference")
if len(ref_matrix):
    R.show(compare.rel_diff_heatmap(ref_matrix, title="rel_diff: served chunk x target layer (reference)",
                              tolerance=tol))

# %% [markdown]
# ## Per-token rel_diff
#
# Slot i of the served row against slot i of the training row, token by token: a constant offset points at a
# wiring fault, isolated spikes at numerics.

# %%
pairs = compare.aligned_rows(served_dump, ctx.training, H, max_samples=max_samples)
per_token = compare.per_token_rel_diff(pairs, H)
if len(per_token):
    samples = list(dict.fromkeys(per_token["sample"]))
    R.interactive(lambda sample, chunk: compare.per_token_figure(per_token, sample, chunk, tolerance=tol),
                  {"sample": samples, "chunk": ["all"] + sorted(int(c) for c in per_token["chunk"].unique())},
                  caption="first sample, all chunks")
    R.show(compare.rel_diff_histograms(per_token, tolerance=tol))
else:
    R.show(R.note("No served sample shares its tokens with a training sample."))

# %% [markdown]
# ## The minimum tolerance that would pass
#
# How loose a comparison would have to be to call the served tensor "equal" to training, per slot and overall
# ("all"): a wiring fault needs an absurd tolerance, numerics a small one.

# %%
min_tol = compare.min_tolerance_frame(diag, per_token)
R.show(min_tol)

# %%
R.write_result(ctx, "03_compare", {
    "served": str(served_dump), "verdict": diag.verdict, "findings": diag.findings, "chunks": diag.chunks,
    "tolerance": tol, "rel_diff": matrix.to_dict(), "reference_rel_diff": ref_matrix.to_dict(),
    "min_tolerance": min_tol.to_dict(orient="records")})
