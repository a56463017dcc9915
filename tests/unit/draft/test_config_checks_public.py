"""The config-only draft checks (helpers/draft/config_checks.py, ``diagnose --draft-config D --target-config T``) on
whole public draft / target config.json files (``tests/data/public_configs.yaml`` entries with ``draft_file``:
SpecForge, AngelSlim, TorchSpec incl. an MLA draft for Kimi-K2.5, speculators, SafeAILab EAGLE drafts, their targets'
configs from ai-dynamo/aiconfigurator), on variants of them with one field changed, and against SGLang 0.5.23's own
``ModelConfig`` / ``get_context_length`` / ``get_rope`` run on the same files in the reference venv."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.cli.diagnose import cli_main
from helpers.draft.config_checks import check_configs
from helpers.paths import ROOT
from support import DATA

ENTRIES = [e for e in yaml.safe_load((DATA / "public_configs.yaml").read_text()) if "draft_file" in e]
SGLANG_PY = ROOT / "env" / "reference" / ".venv" / "bin" / "python"


def entry(name: str) -> dict:
    return next(e for e in ENTRIES if e["name"] == name)


def pair(tmp: Path, e: dict, edit=None, name: str = "pair") -> tuple[Path, Path]:
    """The entry's two files as folders under ``tmp/name``; ``edit(draft_cfg)`` changes the draft config."""
    d, t = tmp / name / "draft", tmp / name / "target"
    d.mkdir(parents=True)
    t.mkdir(parents=True)
    cfg = json.loads((DATA / e["draft_file"]).read_text())
    if edit is None:
        shutil.copy(DATA / e["draft_file"], d / "config.json")
    else:
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(DATA / e["target_file"], t / "config.json")
    return d, t


def kinds(rep) -> list[str]:
    return sorted({f["kind"] for f in rep.findings})


def test_the_files_are_verbatim_cited_and_cover_the_trainers():
    assert len(ENTRIES) >= 12
    for e in ENTRIES:
        for role in ("draft", "target"):
            src = e[f"{role}_source"]
            assert {"repo", "path", "commit", "date", "url"} <= set(src) and len(src["commit"]) == 40, e["name"]
            body = (DATA / e[f"{role}_file"]).read_bytes()
            assert hashlib.sha256(body).hexdigest() == e[f"{role}_sha256"], (e["name"], role)
            json.loads(body)
    repos = {e["draft_source"]["repo"] for e in ENTRIES}
    assert {"sgl-project/SpecForge", "Tencent/AngelSlim", "lightseekorg/TorchSpec", "vllm-project/speculators",
            "SafeAILab/EAGLE"} <= repos
    mla = [e for e in ENTRIES if json.loads((DATA / e["draft_file"]).read_text())["architectures"] ==
           ["Eagle3DeepseekV2ForCausalLM"]]
    assert len(mla) >= 2
    # the corpus holds pairs where SGLang refuses the draft's context and pairs it accepts, equal and unequal ropes
    assert {e["expected_position"]["start"] for e in ENTRIES} == {"ok", "refused"}
    assert any(e["expected_position"]["rope_differs"] for e in ENTRIES)
    assert any(not e["expected_position"]["rope_differs"] for e in ENTRIES)


@pytest.mark.parametrize("e", ENTRIES, ids=lambda e: e["name"])
def test_config_only_checks_on_public_pairs(tmp_path, e):
    d, t = pair(tmp_path, e)
    rep = check_configs(d, t)
    exp, pos = e["expected"], e["expected_position"]
    assert kinds(rep) == sorted(set(exp["findings"]) | set(pos["findings"])), rep.render_text()
    assert rep.verdict == ("mismatch" if rep.findings else exp["verdict"])
    assert rep.served_plan.tensors == exp["served"]
    facts = rep.draft_checks["facts"]
    ctx = facts["context_length"]
    assert (ctx["draft"], ctx["target"]) == (pos["draft_context"], pos["target_context"]), pos["why"]
    assert ctx["start"].split(":")[0] == pos["start"]
    assert sorted(facts["rope"]["differs_from_target"]) == sorted(pos["rope_differs"])
    assert facts["rope"]["sglang_changes"] == {}
    notes = rep.draft_checks["notes"]
    # a rope unlike the target's is a note naming each field, never a finding
    rope_note = [n for n in notes if n.startswith("the draft's rope differs")]
    assert len(rope_note) == (1 if pos["rope_differs"] else 0)
    for k in pos["rope_differs"]:
        assert k in rope_note[0]
    if pos["start"] == "refused":
        f = [f for f in rep.findings if f["kind"] == "max_position_short"]
        if f:                            # a servable draft: the finding, with the fields and SGLang's rule
            ev = f[0]["evidence"]
            assert (ev["draft_context_length"], ev["target_context_length"]) == (ctx["draft"], ctx["target"])
            assert "_derive_context_length" in ev["source"] and "eagle_worker_v2.py" in ev["source"]
            assert f"--context-length {ctx['draft']}" in ev["fix"]
        else:                            # an unsupported draft: the same check as a note "once converted"
            assert any(n.startswith("once converted") and "[max_position_short]" in n for n in notes)


def test_cli_on_real_pairs_file_or_folder(tmp_path, capsys):
    e = entry("specforge-full-llama3.1-8b")
    d, t = pair(tmp_path, e)
    # a config.json file for the draft, a folder for the target: exit 1, the finding and the facts in the JSON
    assert cli_main(["--draft-config", str(d / "config.json"), "--target-config", str(t), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "mismatch" and [f["kind"] for f in doc["findings"]] == ["max_position_short"]
    assert doc["draft_checks"]["facts"]["context_length"]["draft"] == 2048
    assert any("never the target's" in a for a in doc["advisories"])
    # the text report: the context line, the finding and the rope note
    assert cli_main(["--draft-config", str(d), "--target-config", str(t / "config.json")]) == 1
    out = capsys.readouterr().out
    assert "context length: draft 2048 (max_position_embeddings), target 131072" in out
    assert "[max_position_short]" in out and "note: the draft's rope differs" in out
    # a clean real pair: exit 0
    d, t = pair(tmp_path, entry("specforge-full-qwen3-8b"), name="qwen")
    assert cli_main(["--draft-config", str(d), "--target-config", str(t)]) == 0
    capsys.readouterr()


# ------------------------------------------------------------------------ variants of real pairs, one field changed

def _max_pos(n):
    return lambda c: c.update(max_position_embeddings=n)


VARIANTS = {
    # name: (entry, edit, expected finding kinds of the draft checks, expected facts)
    "llama3.1-8b-long-context": ("specforge-full-llama3.1-8b", _max_pos(131072), [], {"draft": 131072}),
    "qwen3-8b-short-context": ("specforge-full-qwen3-8b", _max_pos(4096), ["max_position_short"], {"draft": 4096}),
    "qwen3-8b-theta-10000": ("specforge-full-qwen3-8b", lambda c: c.update(rope_theta=10000.0), [], {"draft": 40960}),
    "kimi-k25-two-originals": ("torchspec-kimi-k25", lambda c: c.update(original_max_position_embeddings=2048),
                               ["rope_mismatch"], {"draft": 262144}),
    "qwen3-8b-window-on": ("specforge-full-qwen3-8b",
                           lambda c: c.update(use_sliding_window=True, sliding_window=4096),
                           ["sliding_window_ignored"], {"draft": 40960}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants_of_real_pairs(tmp_path, name):
    base, edit, want, ctx = VARIANTS[name]
    e = entry(base)
    d, t = pair(tmp_path, e, edit)
    rep = check_configs(d, t)
    assert kinds(rep) == sorted(set(e["expected"]["findings"]) | set(want)), rep.render_text()
    facts = rep.draft_checks["facts"]
    assert facts["context_length"]["draft"] == ctx["draft"]
    if name == "qwen3-8b-theta-10000":
        # the draft now runs theta 10000 where the target has 1000000: SGLang serves the draft's own, a note
        assert facts["rope"]["sglang_builds"]["rope_theta"] == 10000.0
        assert facts["rope"]["differs_from_target"] == {"rope_theta": [10000.0, 1000000.0]}
    if name == "kimi-k25-two-originals":
        ch = facts["rope"]["sglang_changes"]["original_max_position_embeddings"]
        assert (ch["config"], ch["sglang"]) == (4096, 2048)
        assert facts["rope"]["sglang_builds"]["scaling"]["original_max_position_embeddings"] == 2048


# ----------------------------------------------------------------------- the same files read by SGLang 0.5.23 itself

@pytest.mark.skipif(not SGLANG_PY.exists(), reason="env/reference/.venv (sglang 0.5.23) not installed")
def test_sglang_reads_the_pairs_as_the_checks_do(tmp_path):
    """One SGLang process builds each pair the way the server does (tests/support/sglang_draft_configs.py): the
    context lengths it derives, whether ModelConfig refuses the draft at the target's context, the rope the draft's
    attention gets (and, for the two-originals variant, get_rope's table) -- and the checks must say the same."""
    jobs, reports = [], {}
    cases = [(e["name"], e, None) for e in ENTRIES] + [(n, entry(v[0]), v[1]) for n, v in VARIANTS.items()]
    for name, e, edit in cases:
        d, t = pair(tmp_path, e, edit, name=name)
        jobs.append({"name": name, "draft": str(d), "target": str(t), "cache": name == "kimi-k25-two-originals"})
        reports[name] = check_configs(d, t).draft_checks["facts"]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    env.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)
    env.pop("SGLANG_IS_IN_CI", None)
    proc = subprocess.run([str(SGLANG_PY), str(ROOT / "tests" / "support" / "sglang_draft_configs.py"),
                           str(tmp_path / "jobs.json"), str(tmp_path / "out.json")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    for name, facts in reports.items():
        sg = got[name]
        assert "error" not in sg, (name, sg)
        ctx = facts["context_length"]
        assert (sg["draft_derived"], sg["target_context"]) == (ctx["draft"], ctx["target"]), name
        assert (sg["refused"] is not None) == ctx["start"].startswith("refused"), (name, sg["refused"])
        if sg["refused"] is not None:    # with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1: raised to the target's
            assert sg["served_max_position"] == ctx["target"], name
        served = facts["rope"]["sglang_builds"]
        assert float(sg["rope"]["rope_theta"]) == served["rope_theta"], name
        scaling = {k: v for k, v in (sg["rope"]["rope_scaling"] or {}).items()
                   if k not in ("rope_theta", "rope_type", "type")}
        assert scaling == served["scaling"], name
        sg_type = (sg["rope"]["rope_scaling"] or {}).get("rope_type", "default")
        assert sg_type == served["rope_type"], name
        changed = bool(facts["rope"]["sglang_changes"])
        assert (sg["rope"] != sg["config_rope"]) == changed, name
    assert got["kimi-k25-two-originals"]["cache_equal"] is False       # SGLang's rotary table itself differs


def test_config_class_defaults_are_transformers_own():
    """A field a draft config leaves out gets its config class's default (SGLang loads configs through AutoConfig;
    kimi_k2 is SGLang's alias of DeepseekV3Config): the table the checks use, against transformers 5's classes."""
    from transformers import DeepseekV2Config, DeepseekV3Config, LlamaConfig   # lazy: only this test needs them

    from helpers.draft.params import CONFIG_DEFAULTS
    for model_type, cls in (("llama", LlamaConfig), ("deepseek_v2", DeepseekV2Config),
                            ("deepseek_v3", DeepseekV3Config), ("kimi_k2", DeepseekV3Config)):
        c = cls()
        for k, v in CONFIG_DEFAULTS[model_type].items():
            got = c.rope_parameters["rope_theta"] if k == "rope_theta" else getattr(c, k)
            assert got == v, (model_type, k, got, v)


@pytest.mark.parametrize("edit,field", [
    (lambda c: c.update(rope_theta="1e6"), "[rope_theta]"),
    (lambda c: c.update(max_position_embeddings=-5), "[max_position_embeddings]"),
    (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": "two"}), "[rope_scaling.factor]"),
])
def test_unreadable_position_fields_are_one_line_bad_input(tmp_path, capsys, edit, field):
    d, t = pair(tmp_path, entry("specforge-full-qwen3-8b"), edit)
    assert cli_main(["--draft-config", str(d), "--target-config", str(t)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("diagnose: error:") and err.count("\n") == 1 and "config.json" in err and field in err, err
