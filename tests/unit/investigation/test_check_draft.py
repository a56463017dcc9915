"""``investigate --check-draft`` (helpers.investigation.check_draft) against the in-thread fake SGLang of mode
``metrics`` with the reference models' folders: no trace hook is ``undecided`` (exit 3) saying how to start it, a
served draft folder unlike ``--draft`` is ``differs`` (exit 1) naming ``served_draft_differs``, the engine's draft
checksum recorded and compared, the verdict rules, bad input one line exit 2."""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager

import pytest

from helpers.__main__ import main
from helpers.investigation import check_draft as cd
from helpers.investigation.check_draft import CHECK_PROBES, DOC_NAME, EXIT, verdict_of
from helpers.investigation.probes.trace import HOW
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET
from support import fakeserver


class _Metrics(fakeserver.Handler):
    mode = "metrics"


@contextmanager
def fake(draft_path=REFERENCE_DRAFT, handler=_Metrics, **metrics):
    """The in-thread fake of mode ``metrics`` whose /server_info names the reference target and ``draft_path``."""
    fresh = dict(fakeserver.METRICS)
    old_paths = dict(fakeserver.PATHS)
    fakeserver.METRICS.update(metrics)
    fakeserver.PATHS.update(model_path=str(REFERENCE_TARGET), draft_path=str(draft_path))
    try:
        with fakeserver.in_thread(handler) as url:
            yield url
    finally:
        fakeserver.METRICS.clear()
        fakeserver.METRICS.update(fresh)
        fakeserver.PATHS.clear()
        fakeserver.PATHS.update(old_paths)


def _probe(name, status="ran", decision=None, why=None):
    return {"probe": name, "condition": "c", "status": status, "decision": decision, "why": why, "loss": None}


def test_the_verdict_rules():
    clear = {"probes": [_probe("served_draft", decision="clear", why="12 draft steps of 1 request(s) equal"),
                        _probe("step_trace", decision="clear", why="48 draft steps")]}
    assert verdict_of(clear, [])[0] == "matches" and "12 draft steps" in verdict_of(clear, [])[1]
    # step_trace skipped (time) and served_draft clear: matches, on the fixed prompt
    short = {"probes": [clear["probes"][0], _probe("step_trace", "skipped", why="10 s left of the run")]}
    assert verdict_of(short, [])[0] == "matches"
    # a probe that counts names its finding; draft_kv_diverges too (the proposals differ from step 2 on)
    for kind in ("served_draft_differs", "draft_kv_diverges"):
        v, why = verdict_of(clear, [{"kind": kind, "detail": "step 1 at position 12"}])
        assert v == "differs" and why.startswith(kind) and "position 12" in why
    # nothing decided: undecided with each open probe's reason
    none = {"probes": [_probe("served_draft", "skipped", why=HOW), _probe("step_trace", "skipped", why=HOW)]}
    v, why = verdict_of(none, [])
    assert v == "undecided" and "--trace-draft" in why
    fail = {"probes": [_probe("served_draft", "failed", why="HTTP 400"), clear["probes"][1]]}
    assert verdict_of(fail, [])[0] == "undecided"
    open_ = {"probes": [_probe("served_draft", decision="undecided", why="no traced request could be aligned")]}
    assert verdict_of(open_, []) == ("undecided", "served_draft (c): undecided: no traced request could be aligned")
    assert verdict_of({"probes": []}, [])[0] == "undecided"
    assert EXIT == {"matches": 0, "differs": 1, "undecided": 3} and CHECK_PROBES == ("served_draft", "step_trace")


def test_no_trace_hook_is_undecided_exit_3_saying_how(tmp_path, capsys):
    with fake(draft_checksum="ab" * 32) as url:
        rc = main(["investigate", "--url", url, "--check-draft", "--target", str(REFERENCE_TARGET), "--out",
                   str(tmp_path)])
        assert fakeserver.METRICS["requests"] == 0                      # nothing to trace: no request sent
    assert rc == 3
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("served draft undecided: served_draft (the served draft on a fixed input): skipped: "
                             "the server runs no draft step trace: start it with `python -m helpers server start "
                             "--trace-draft DIR`")
    (run,) = tmp_path.iterdir()
    assert run.name.endswith("check-draft-127.0.0.1-" + url.rsplit(":", 1)[1])
    doc = json.loads((run / DOC_NAME).read_text())
    assert doc["verdict"] == "undecided" and doc["exit"] == 3 and doc["error"] is None
    assert [p["probe"] for p in doc["engine_state"]["probes"]] == ["served_draft", "step_trace"]  # nothing else
    w = doc["weights"]
    assert w["checksum"] == "ab" * 32 and w["ranks"] == [{"role": "draft", "tp_rank": 0, "tensors": 1,
                                                          "checksum": "ab" * 32}]
    assert w["changed"] is None and "weights_checker" in w["source"]


def test_a_served_draft_folder_unlike_the_given_one_differs_exit_1(tmp_path, capsys):
    other = tmp_path / "served-draft"
    shutil.copytree(REFERENCE_DRAFT, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = float(cfg.get("rope_theta") or 10000.0) * 2      # another checkpoint's config
    (other / "config.json").write_text(json.dumps(cfg))
    with fake(draft_path=other) as url:
        rc = main(["investigate", "--url", url, "--check-draft", "--draft", str(REFERENCE_DRAFT), "--target",
                   str(REFERENCE_TARGET), "--out", str(tmp_path / "out"), "--json"])
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "differs" and doc["exit"] == 1
    (f,) = doc["findings"]
    assert f["kind"] == "served_draft_differs" and "rope_theta" in f["evidence"]["differences"]["config_keys"]
    assert doc["reason"].startswith("served_draft_differs: the server runs the draft in")
    # the engine has no checksum route here (404): a note, not a failure
    assert doc["weights"]["checksum"] is None and any("reports no checksum" in n for n in doc["notes"])


def test_a_probe_that_finds_the_served_draft_differs_is_exit_1_and_the_checksum_change_is_said(tmp_path, capsys,
                                                                                            monkeypatch):
    seen = {}

    def fake_probes(ctx, which="cheap", only=None, **kw):
        seen.update(which=which, only=only, prompts=len(ctx.prompts), tokens=ctx.max_new_tokens)
        f = {"kind": "served_draft_differs", "detail": "the served draft's step-1 proposals differ (fixed: step 1 at "
             "position 12)", "evidence": {"probe": "served_draft"}}
        return {"asked": which, "probes": [_probe("served_draft", decision="counts")], "findings": [f],
                "notes": [], "seconds": 0.1}

    monkeypatch.setattr(cd, "run_probes", fake_probes)
    with fake(draft_checksum="cd" * 32) as url:
        doc = cd.check_draft(url, run_dir=tmp_path / "run", target=REFERENCE_TARGET, previous_checksum="ab" * 32,
                             prompts=2, max_new_tokens=8)
    assert seen == {"which": "cheap", "only": CHECK_PROBES, "prompts": 2, "tokens": 8}
    assert doc["verdict"] == "differs" and doc["exit"] == 1 and "position 12" in doc["reason"]
    assert doc["weights"]["changed"] is True and "changed since the previous check" in doc["weights"]["note"]
    assert json.loads((tmp_path / "run" / DOC_NAME).read_text())["verdict"] == "differs"
    with pytest.raises(Exception, match="already holds a check"):
        cd.check_draft("http://127.0.0.1:1", run_dir=tmp_path / "run", target=REFERENCE_TARGET)


def test_run_probes_only_runs_the_named_probes_and_refuses_unknown_ones(tmp_path):
    from helpers.investigation.probes import run_probes
    from helpers.errors import BadInput

    with pytest.raises(BadInput, match="no such engine-state probe: nope"):
        run_probes(None, "cheap", only=("served_draft", "nope"))


@pytest.mark.parametrize("args, says", [
    (["--check-draft", "--prompts", "0"], "--check-draft needs --prompts >= 1"),
    (["--check-draft", "--max-new-tokens", "1"], "--max-new-tokens >= 2"),
    (["--check-draft", "--timeout", "0"], "--timeout must be > 0"),
    (["--check-draft", "--draft", "/nonexistent/draft"], "--draft"),
    (["--training", " "], "--training is empty"),
])
def test_bad_check_draft_input_is_one_line_exit_2(args, says, capsys, tmp_path):
    assert main(["investigate", "--url", "http://127.0.0.1:1", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not list(tmp_path.iterdir())                                  # refused before any folder


def test_a_failing_draft_checksum_is_a_note_not_the_checks_failure(tmp_path):
    class _Refuses(_Metrics):
        def do_POST(self):
            if self.path.startswith("/weights_checker"):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                return self._json({"success": False, "message": "checksum failed on rank 1"}, 400)
            return super().do_POST()

    with fake(handler=_Refuses) as url:
        doc = cd.check_draft(url, run_dir=tmp_path / "run")
    assert doc["verdict"] == "undecided" and doc["weights"]["checksum"] is None
    assert "HTTP 400: checksum failed on rank 1" in doc["weights"]["note"] and doc["weights"]["note"] in doc["notes"]


class _NoSpec(fakeserver.Handler):
    mode = "nospec"


@pytest.mark.parametrize("cmd", [["--check-draft"], ["--training", "env/models/data/sample", "--no-apply"]])
def test_a_server_without_speculative_decoding_is_named_as_such(cmd, tmp_path, capsys):
    """A server started without a draft: the error says it runs no speculative decoding (it blamed --draft), exit 2,
    before any request is sent."""
    with fake(handler=_NoSpec) as url:
        rc = main(["investigate", "--url", url, *cmd, "--target", str(REFERENCE_TARGET), "--out", str(tmp_path)])
        assert fakeserver.METRICS["requests"] == 0
    err = capsys.readouterr().err
    assert rc == 2 and "runs no speculative decoding" in err and "--draft was given" not in err


# --------------------------------------------------------------------------- breaker items 13 and the checksum
def test_a_changed_draft_checksum_never_matches():
    clear = {"probes": [_probe("served_draft", decision="clear", why="12 draft steps equal"),
                        _probe("step_trace", decision="clear", why="48 draft steps")]}
    same = {"checksum": "ab" * 32, "previous": "ab" * 32, "changed": False}
    moved = {"checksum": "cd" * 32, "previous": "ab" * 32, "changed": True}
    assert verdict_of(clear, [], same)[0] == "matches" and verdict_of(clear, [], {"changed": None})[0] == "matches"
    v, why = verdict_of(clear, [], moved)
    assert v == "undecided"
    assert "checksum changed since the previous check (abababababababab -> cdcdcdcdcdcdcdcd)" in why
    assert "12 draft steps equal" in why
    # a probe's finding still decides
    assert verdict_of(clear, [{"kind": "served_draft_differs", "detail": "x"}], moved)[0] == "differs"


def _probes_raising(monkeypatch, exc):
    import dataclasses
    from helpers.investigation import probes as pr
    from helpers.investigation.probes.trace import SERVED_DRAFT, STEP_TRACE

    def run(ctx):
        raise exc

    fakes = tuple(dataclasses.replace(p, run=run, applies=lambda ctx: None, estimate_s=lambda ctx: 1.0)
                  for p in (SERVED_DRAFT, STEP_TRACE))
    monkeypatch.setattr(pr, "PROBES", fakes)


def test_a_server_failing_during_the_check_is_exit_1_a_refused_request_undecided(tmp_path, capsys, monkeypatch):
    from helpers.errors import RequestRejected, ServerUnavailable
    _probes_raising(monkeypatch, ServerUnavailable("POST /generate: HTTP 503 after 3 tries", endpoint="/generate",
                                                   status=503))
    with fake() as url:
        rc = main(["investigate", "--url", url, "--check-draft", "--target", str(REFERENCE_TARGET), "--out",
                   str(tmp_path / "a")])
    assert rc == 1
    assert "HTTP 503" in capsys.readouterr().err
    (run,) = (tmp_path / "a").iterdir()
    doc = json.loads((run / DOC_NAME).read_text())
    assert doc["verdict"] is None and "HTTP 503" in doc["error"]
    _probes_raising(monkeypatch, RequestRejected("POST /generate: HTTP 400: no hidden states", endpoint="/generate",
                                                 status=400))
    with fake() as url:
        rc = main(["investigate", "--url", url, "--check-draft", "--target", str(REFERENCE_TARGET), "--out",
                   str(tmp_path / "b")])
    assert rc == 3 and "served draft undecided" in capsys.readouterr().out


@pytest.mark.parametrize("args, says", [
    (["--timeout", "20"], "[--timeout]: 20 s is too short for any probe of the check: give at least 68 s"),
    (["--timeout", "30", "--prompts", "1", "--max-new-tokens", "2"], "give at least 65 s"),
    (["--timeout", "inf"], "--timeout must be > 0 seconds and finite, got inf"),
    (["--timeout", "nan"], "--timeout must be > 0 seconds and finite, got nan"),
    (["--training", "/nonexistent"], "--check-draft takes only --url, --check-draft, --draft, --target, --out, "
                                     "--timeout, --prompts, --max-new-tokens, --api-key-env, --json; got --training"),
    (["--sweeps", "bogus", "--relaunch", "x --host 0.0.0.0"], "got --relaunch, --sweeps"),
    (["--engine-probes", "all", "--probe-top-k", "5"], "got --engine-probes, --probe-top-k"),
])
def test_check_draft_refuses_what_it_cannot_use_up_front(args, says, capsys, tmp_path):
    assert main(["investigate", "--url", "http://127.0.0.1:1", "--check-draft", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err
    assert not list(tmp_path.iterdir())


def test_the_skip_for_time_says_the_reserve(tmp_path):
    from helpers.budget import Budget
    from helpers.investigation.probes import RESERVE_S, _one
    from helpers.investigation.probes.trace import SERVED_DRAFT
    import dataclasses
    p = dataclasses.replace(SERVED_DRAFT, applies=lambda ctx: None, estimate_s=lambda ctx: 30.0)
    r = _one(p, type("C", (), {"dl": Budget(80.0), "att": None})(), "cheap")
    assert RESERVE_S == 60.0 and r.status == "skipped"
    assert r.why.startswith("80 s left of the run (--timeout); it needs about 30 s plus the 60 s every probe leaves")
