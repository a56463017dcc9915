"""A case file given as ``suite run --params`` runs the main job (env/cases/main.yaml) on that case: same notebooks,
timeouts and server block, the case's name for the run folder; an invalid case is refused (exit 2) naming the case
field; a params file is read as before."""
from __future__ import annotations

import pytest
import yaml

from helpers.cli import suite as suite_cli
from helpers.errors import BadParams
from helpers.suite.params import MAIN_PARAMS, load_params
from support import ROOT

CASES = ROOT / "env" / "cases"


def test_a_case_file_runs_with_the_main_jobs_params():
    main = load_params(MAIN_PARAMS)
    llama = load_params(CASES / "seeds_hunt.yaml")
    assert main.name == "kimi-seeds-hunt" and main.case == str((CASES / "kimi_seeds_hunt.yaml").resolve())
    assert llama.name == "seeds-hunt" and llama.case == str((CASES / "seeds_hunt.yaml").resolve())
    assert llama.model_dump(exclude={"name", "case"}) == main.model_dump(exclude={"name", "case"})
    assert llama.timeout_per_notebook == 1800 and llama.notebooks[0] == "00_replay"


def test_an_invalid_case_file_is_refused_naming_the_case(tmp_path, capsys):
    case = yaml.safe_load((CASES / "seeds_hunt.yaml").read_text())
    case["timeline"][2]["hypothesis"]["check"] = "no_such_check"
    p = tmp_path / "bad_case.yaml"
    p.write_text(yaml.safe_dump(case))
    with pytest.raises(BadParams, match=r"field 'case'.*no_such_check"):
        load_params(p)
    assert suite_cli.cli_main(["run", "--params", str(p), "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no_such_check" in err and "\n" not in err
    assert not (tmp_path / "runs").exists()
