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


@pytest.mark.parametrize("edit, field", [
    ({"draft_dir": "no/such/draft"}, "draft_dir"),
    ({"training_data": "env/models/data/no_such_sample"}, "training_data"),
    ({"server": {"url": "127.0.0.1:30000"}}, "server.url"),
    ({"server": {"managed": {"draft": "env/models/no_such_draft"}}}, "server.managed.draft"),
    ({"server": {"managed": {"draft": "env/cases/main.yaml"}}}, "server.managed.draft"),
    ({"server": {"managed": {"spec": {"num_steps": 0}}}}, "server.managed.spec"),
    ({"server": {"managed": {"spec": {"steps": 3}}}}, "server.managed.spec"),
    ({"server": {"url": "http://:"}}, "server.url"),
    ({"server": {"url": "http:// x"}}, "server.url"),
    ({"case": ""}, "case"),
    ({"notebooks": []}, "notebooks"),
])
def test_a_params_file_naming_what_does_not_exist_is_refused_before_anything_runs(tmp_path, edit, field):
    """A model folder that does not exist, or a server URL without its scheme, is one line naming the field at load
    time, not a notebook failing half way through the run."""
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"name": "x", "notebooks": ["00_investigate"], "server": {"url": "http://127.0.0.1:1"},
                                 **edit}))
    with pytest.raises(BadParams, match=rf"params\.yaml: field '{field}'|params\.yaml.*{field}") as e:
        load_params(p)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("models, spec, match", [
    ({"draft": "env/models/no_such_draft"}, None, r"field 'models\.draft': env/models/no_such_draft not found"),
    ({"training_data": "env/models/data/nothing"}, None, r"field 'models\.training_data'"),
    (None, {"num_steps": -1}, r"num_steps.*greater than or equal to 1"),
])
def test_a_case_whose_models_are_missing_or_steps_negative_is_refused(tmp_path, models, spec, match):
    case = yaml.safe_load((CASES / "seeds_hunt.yaml").read_text())
    if models:
        case["models"] = {**case.get("models", {}), **models}
    if spec:
        case["server"]["spec"] = {**case["server"]["spec"], **spec}
    p = tmp_path / "case.yaml"
    p.write_text(yaml.safe_dump(case))
    with pytest.raises(BadParams, match=match):
        load_params(p)
