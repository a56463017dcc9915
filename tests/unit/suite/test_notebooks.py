"""Notebook hygiene: no outputs in git, papermill-ready (kernelspec python3, one `parameters` cell with the
suite's common parameters), paired with a jupytext py:percent file holding the same cells, thin (logic lives
in helpers/)."""
from __future__ import annotations

import ast

import jupytext
import nbformat
import pytest

from helpers.suite import params as suite_params
from support import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: every page names the run folder it works on and the checkout it resolves paths against; the other common
#: parameters (server_url, api_key_env, case, target_dir, draft_dir, training_data) only where the page uses them
COMMON = {"run_dir", "repo_root"}


def test_the_suite_notebooks_exist():
    names = {p.stem for p in NOTEBOOKS}
    assert set(suite_params.DEFAULT_NOTEBOOKS) <= names, set(suite_params.DEFAULT_NOTEBOOKS) - names
    assert suite_params.DEFAULT_NOTEBOOKS[0] == "00_replay" and suite_params.DEFAULT_NOTEBOOKS[-1] == "99_postmortem"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_clean_and_parameterised(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: outputs committed"
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1, f"{path.name}: exactly one cell tagged 'parameters'"
    names = {t.id for node in ast.parse(params[0].source).body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)}
    assert COMMON <= names, f"{path.name}: parameters lack {COMMON - names}"
    for line in params[0].source.splitlines():  # papermill cannot parse a line with two '='
        assert line.count("=") <= 1, f"{path.name}: {line!r}"
        assert "unused" not in line.lower(), f"{path.name}: a parameter documented as unused: {line!r}"
    rest = "\n".join(c.source for c in nb.cells if c.cell_type == "code" and c is not params[0])
    used = {n.id for n in ast.walk(ast.parse(rest)) if isinstance(n, ast.Name)}
    assert names <= used, f"{path.name}: parameters declared but never used: {sorted(names - used)}"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "from helpers.views import common as R" in code and "R.setup_notebook()" in code
    assert len(code.splitlines()) < 90, f"{path.name}: notebooks stay thin; move logic to helpers/"
    assert "SGLANG_API_KEY\"]" not in code and "os.environ[" not in code, "keys are read in helpers only"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_with_its_py_percent_file(path):
    text = path.with_suffix(".py")
    assert text.exists(), f"{text.name} missing (jupytext --set-formats ipynb,py:percent)"
    assert "# %% tags=[\"parameters\"]" in text.read_text()
    a = nbformat.read(path, as_version=4)
    b = jupytext.read(text)
    assert [(c.cell_type, c.source.strip()) for c in a.cells] == [(c.cell_type, c.source.strip()) for c in b.cells]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_records_the_kernels_language_info(path):
    """JupyterLab writes the kernel's ``language_info`` into the notebook's metadata when the kernel starts; a notebook
    that lacks it, or holds another Python's, is marked unsaved as soon as it opens (the browser test,
    tests/suite/test_lab_browser.py, sees the tab clean)."""
    from ipykernel.ipkernel import IPythonKernel

    nb = nbformat.read(path, as_version=4)
    assert nb.metadata.get("language_info") == IPythonKernel.language_info, (
        f"{path.name}: metadata.language_info differs from this Python's kernel; set it to "
        "ipykernel.ipkernel.IPythonKernel.language_info")
