"""helpers.acceptance.ledger / fixes: run folders, the append-only ledger under concurrent writers, fixes files.
Managed mode against real reference servers: tests/server/test_managed_fixes.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from helpers.__main__ import main
from helpers.acceptance.fixes import load_fixes
from helpers.acceptance.ledger import Ledger, LedgerUnreadable
from helpers.acceptance.measure import measure, rebuild_ledger
from helpers.errors import BadInput
from helpers.runfiles import atomic_write_text, new_run_dir
from support import ROOT
from support.fakeserver import fake_server


WRITER = textwrap.dedent("""
    import sys, time
    from helpers.acceptance.ledger import Ledger
    path, writer, n, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    while time.time() < go:
        time.sleep(0.001)
    led = Ledger(path)
    for i in range(n):
        led.append({"fix": f"{writer}-{i}", "writer": writer, "seq": i, "accept_length": 1.0 + i / 100})
""")


def test_two_processes_appending_at_once_lose_no_row(tmp_path):
    path = tmp_path / "run" / "ledger.parquet"
    Ledger(path).append({"fix": "first", "writer": "main", "seq": 0, "accept_length": 2.0})
    go = time.time() + 2.0
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    n = 25
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), w, str(n), str(go)], env=env,
                              stderr=subprocess.PIPE, text=True) for w in ("A", "B")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    df = Ledger(path).read()
    assert len(df) == 1 + 2 * n
    assert df["row_id"].is_unique
    for w in ("A", "B"):
        assert sorted(df.loc[df["writer"] == w, "seq"]) == list(range(n))
    assert df["fix"].iloc[0] == "first"  # the oldest row is still first: appends never reorder
    # the writers really overlapped in time (else this test would prove nothing)
    times = df.groupby("writer")["appended_at"].agg(["min", "max"])
    assert times.loc["A", "min"] < times.loc["B", "max"] and times.loc["B", "min"] < times.loc["A", "max"]
    assert not list(path.parent.glob(".ledger.parquet.*.tmp"))  # no temp files left


def test_ledger_keeps_rows_and_schema_grows(tmp_path):
    led = Ledger(tmp_path / "ledger.parquet")
    assert led.read().empty
    led.append({"fix": "a", "accept_length": 1.5, "overrides": ["max_running_requests"]})
    led.append([{"fix": "b", "accept_length": 2.5, "new_col": "x"}, {"fix": "c", "error": "boom"}])
    df = led.read()
    assert list(df["fix"]) == ["a", "b", "c"]
    assert json.loads(df["overrides"].iloc[0]) == ["max_running_requests"]
    assert pd.isna(df["new_col"].iloc[0]) and df["new_col"].iloc[1] == "x"
    with pytest.raises(ValueError):
        led.append([])


def test_unreadable_ledger_is_never_overwritten(tmp_path):
    p = tmp_path / "ledger.parquet"
    p.write_bytes(b"not parquet at all")
    with pytest.raises(LedgerUnreadable, match="left as is") as err:
        Ledger(p).append({"fix": "x"})
    assert isinstance(err.value, BadInput) and err.value.exit_code == 2 and str(err.value).startswith(f"{p}: ")
    assert f"--rebuild-ledger {tmp_path}" in str(err.value)
    assert p.read_bytes() == b"not parquet at all"


@pytest.fixture(scope="module")
def measured():
    """One real measurement of a fake server on 127.0.0.1 (3 prompts x 4 tokens)."""
    with fake_server("ok") as url:
        return measure(url, None, max_new_tokens=4, num_prompts=3, warmup=0, progress=False, n_boot=200,
                       label="m")


def test_rebuild_takes_exactly_the_ledger_measurements(measured, tmp_path, capsys):
    """Issue 30: rebuild_ledger gives back every row record() appended (value for value, in order) from fixes/ and
    acceptance/, and nothing else: not an investigation's acceptance/before (never a ledger row), not a staging
    folder; a damaged summary.json is left out with a line naming it (CLI exit 1), the old ledger kept beside."""
    run = tmp_path / "run"
    measured.record(run, "m")
    measured.record(run, "m", error=None)                       # fixes/m-2, with an extra column
    measured.record(run, "replay step", under="acceptance")      # the replay's and the acceptance page's folder
    measured.save(run / "acceptance" / "before")                 # investigate's: no ledger row
    staging = run / "fixes" / ".m.abc123.tmp"
    staging.mkdir()
    (staging / "summary.json").write_text((run / "fixes" / "m" / "summary.json").read_text())
    original = Ledger(run / "ledger.parquet").read()
    assert list(original["saved_to"]) == ["fixes/m", "fixes/m-2", "acceptance/replay-step"]

    done = rebuild_ledger(run)
    assert done.folders == ["fixes/m", "fixes/m-2", "acceptance/replay-step"] and not done.skipped
    rebuilt = Ledger(run / "ledger.parquet").read()
    # value for value (the column "error", None in every row, may read back as float NaN instead of object None)
    assert rebuilt["error"].isna().all() and original["error"].isna().all()
    pd.testing.assert_frame_equal(rebuilt[original.columns].drop(columns="error"), original.drop(columns="error"))
    assert done.kept_old is not None and done.kept_old.name.startswith("ledger.parquet.before-rebuild-")

    (run / "fixes" / "m-2" / "summary.json").write_text('{"summary": {"label": "m"')     # truncated
    assert main(["measure", "--rebuild-ledger", str(run)]) == 1
    err = capsys.readouterr().err
    assert f"{run / 'fixes' / 'm-2' / 'summary.json'}: measurement summary is not valid JSON" in err, err
    assert "measure: error: 1 measurement folder(s) could not be read" in err, err
    assert list(Ledger(run / "ledger.parquet").read()["saved_to"]) == ["fixes/m", "acceptance/replay-step"]
    assert len(list(run.glob("ledger.parquet.before-rebuild-*"))) == 2


def test_a_ledger_whose_lock_cannot_be_opened_keeps_the_measurement(measured, tmp_path):
    """Issue 30: a measurement is never deleted because of another file's state: the ledger's lock file being a
    folder is bad input naming it, and the measurement just saved stays."""
    run = tmp_path / "run"
    (run / "ledger.parquet.lock").mkdir(parents=True)
    with pytest.raises(LedgerUnreadable, match="lock file cannot be opened") as err:
        measured.record(run, "kept")
    assert str(err.value).startswith(f"{run / 'ledger.parquet.lock'}: ") and "kept in fixes/kept" in str(err.value)
    assert (run / "fixes" / "kept" / "summary.json").exists()


def test_a_readable_ledger_of_another_shape_keeps_the_measurement(measured, tmp_path):
    """Issue 30, found by an adversarial run: a valid Parquet ledger whose rows are not the table this tool writes
    (``row_id`` stored as integers; a map-typed column it never writes) cannot take the new row without loss. That is
    the old file's state: bad input naming the ledger (exit 2), the ledger left byte for byte, the measurement kept so
    that ``--rebuild-ledger`` indexes it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, table in (
            ("row_id_int", pa.table({"fix": ["old"], "row_id": [7], "accept_length": [2.0]})),
            ("map_column", pa.table({"fix": ["old"], "row_id": ["a1"], "accept_length": [2.0],
                                     "extra": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64()))}))):
        run = tmp_path / name
        run.mkdir()
        pq.write_table(table, run / "ledger.parquet")
        before = (run / "ledger.parquet").read_bytes()
        with pytest.raises(LedgerUnreadable, match="another shape: its column (row_id holds integers, not text|extra "
                                                   "holds maps, a type this tool never writes)") as err:
            measured.record(run, "new")
        assert str(err.value).startswith(f"{run / 'ledger.parquet'}: ") and "kept in fixes/new" in str(err.value)
        assert (run / "fixes" / "new" / "summary.json").exists(), name
        assert (run / "ledger.parquet").read_bytes() == before, name


THREADS = textwrap.dedent("""
    import io, os, sys
    import pandas as pd
    from helpers.acceptance.ledger import Ledger
    from helpers.runfiles import parquet_bytes, read_parquet
    def threads():
        return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    before = threads()
    led = Ledger(sys.argv[1])
    led.append({"fix": "a", "accept_length": 2.5, "ids": [1, 3, 4]})
    led.append({"fix": "b", "accept_length": 2.7, "note": None})
    df = led.read()
    assert read_parquet(parquet_bytes(df)).equals(df)
    print(len(df), len(before), len(threads()))
    pd.testing.assert_frame_equal(pd.read_parquet(io.BytesIO(parquet_bytes(df))), df)
    print(len(threads()))
""")


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc/self/task")
def test_ledger_parquet_io_starts_no_arrow_thread(tmp_path):
    """Arrow's thread pools racing interpreter exit aborted `helpers measure` (exit -6, 'terminate
    called without an active exception') in 19 of 600 short runs (bench/bench_parquet_exit.py); our
    Parquet I/O must start none. The last read shows the check can fail: pandas' default
    read_parquet starts pool threads."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", THREADS, str(tmp_path / "ledger.parquet")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    rows, before, after, with_pandas = map(int, out.stdout.split())
    assert rows == 2 and after == before and with_pandas > after, out.stdout


def test_new_run_dir_never_reuses_a_folder(tmp_path):
    a = new_run_dir("same name!", outputs=tmp_path, stamp="20260101-000000")
    b = new_run_dir("same name!", outputs=tmp_path, stamp="20260101-000000")
    assert a.name == "20260101-000000-same-name" and b.name == "20260101-000000-same-name-2"
    atomic_write_text(a / "x.txt", "1")
    atomic_write_text(a / "x.txt", "2")
    assert (a / "x.txt").read_text() == "2" and [p.name for p in a.iterdir()] == ["x.txt"]


@pytest.mark.parametrize("data, message", [
    ({"fixes": [{"name": "a", "launch": {}, "url": "http://x:1"}]}, "not both"),
    ({"fixes": [{"name": "a", "command": "sglang ..."}]}, "url"),
    ({"fixes": [{"name": "a", "launch": {}}, {"name": "a", "launch": {}}]}, "duplicate fix names"),
    ({"fixes": [{"name": "a", "launch": {"tp": 2, "spec": {"steps": 3}}}]}, "fixes.0.launch.spec.steps"),
    ({"fixes": [{"name": "a", "launch": {}, "measure": {"concurency": 2}}]}, "concurency"),
    ({"fixes": []}, "at least 1"),
    ({"fixes": [{"name": "a", "launch": {"extra_args": ["--port=1"]}}]}, "extra_args.*'--port=1' among extra_args sets "
                                                                         "--port"),
])
def test_fixes_file_validation_names_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        load_fixes(data)


def test_fixes_file_loads_from_yaml(tmp_path):
    f = tmp_path / "fixes.yaml"
    f.write_text(yaml.safe_dump({"name": "sweep", "measure": {"max_new_tokens": 16},
                                 "fixes": [{"name": "s3", "launch": {"spec": {"num_steps": 3}}},
                                           {"name": "gpu", "command": "python -m sglang.launch_server",
                                            "url": "http://127.0.0.1:30000"}]}))
    ff = load_fixes(f)
    assert [x.mode for x in ff.fixes] == ["launch", "command"]
    assert ff.fixes[0].launch.draft == "reference" and ff.fixes[0].launch.spec.num_steps == 3
    assert ff.fixes[0].launch.spec.with_launch_defaults().num_draft_tokens == 4     # filled at launch
    assert ff.base_dir == str(tmp_path.resolve()) and ff.measure.max_new_tokens == 16
    bad = tmp_path / "bad.yaml"
    bad.write_text("fixes: [")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_fixes(bad)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "helpers", "measure", "--fixes", str(bad)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "not valid YAML" in out.stderr


def test_a_launch_command_that_never_becomes_healthy_is_stopped(tmp_path):
    """Command mode: a launched process that never answers /health within ``startup_timeout`` fails the fix with
    one line naming the launch command's server, and the process (and its group) is gone afterwards."""
    import socket

    from helpers.acceptance.fixes import FixFailed, ServerSpec, serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pidfile = tmp_path / "pid"
    cmd = f"{sys.executable} -c \"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); " \
          "time.sleep(120)\""
    spec = ServerSpec(command=cmd, url=f"http://127.0.0.1:{port}", startup_timeout=3)
    t0 = time.monotonic()
    with pytest.raises(FixFailed, match="server of the launch command"):
        with serve(spec, log_path=tmp_path / "server.log"):
            pass
    assert time.monotonic() - t0 < 30
    pid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the launched process {pid} outlived the failed start")


def test_a_foreign_parquet_file_as_the_ledger_is_bad_input(measured, tmp_path, capsys):
    """Issue 40: a valid Parquet file of another table (no ``fix``, no ``row_id``) in a run folder's place of the
    ledger is never merged with the new row (it was rewritten as a merged table, exit 0): bad input naming the file and
    the columns a ledger has, the file left byte for byte, the new measurement kept in its folder -- through the API
    and through `measure --run-dir` against a fake server."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = tmp_path / "run"
    run.mkdir()
    pq.write_table(pa.table({"city": ["Oslo", "Lima"], "population": [709000, 10000000]}), run / "ledger.parquet")
    before = (run / "ledger.parquet").read_bytes()
    with pytest.raises(LedgerUnreadable) as err:
        measured.record(run, "new")
    msg = str(err.value)
    assert msg.startswith(f"{run / 'ledger.parquet'}: the ledger cannot be read (a Parquet table of another shape: "
                          "its columns are city, population; a ledger's rows all have fix, row_id, it lacks fix, "
                          "row_id)"), msg
    assert "kept in fixes/new" in msg and err.value.exit_code == 2
    assert (run / "fixes" / "new" / "summary.json").exists()
    assert (run / "ledger.parquet").read_bytes() == before
    with pytest.raises(LedgerUnreadable, match="another shape"):
        Ledger(run / "ledger.parquet").read()
    with fake_server("ok") as url:
        rc = main(["measure", "--url", url, "--run-dir", str(run), "--label", "cli", "--num-prompts", "2",
                   "--max-new-tokens", "4", "--warmup", "0", "--quiet", "--timeout", "60"])
    err_lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if "error" in ln and
                 not ln.startswith("warning:")]
    assert rc == 2 and len(err_lines) == 1, err_lines
    assert err_lines[0].startswith(f"measure: error: {run / 'ledger.parquet'}: the ledger cannot be read (a Parquet "
                                   "table of another shape") and "kept in fixes/cli" in err_lines[0], err_lines
    assert (run / "fixes" / "cli" / "summary.json").exists() and (run / "ledger.parquet").read_bytes() == before
    # an empty table written by this tool (a rebuild from no measurement folder: pandas' schema record) is a ledger
    # of no row; a table of no column written by anything else is not (issue 40: it was replaced by a one-row ledger)
    (tmp_path / "none").mkdir()
    assert rebuild_ledger(tmp_path / "none").kept_old is None
    assert Ledger(tmp_path / "none" / "ledger.parquet").read().empty
    measured.record(tmp_path / "none", "first")
    assert list(Ledger(tmp_path / "none" / "ledger.parquet").read()["fix"]) == ["first"]


def _foreign(tmp_path, name, table):
    import pyarrow.parquet as pq
    run = tmp_path / name
    run.mkdir()
    pq.write_table(table, run / "ledger.parquet")
    return run, (run / "ledger.parquet").read_bytes()


def test_tables_that_are_not_this_tools_ledger_are_refused_and_left_byte_for_byte(measured, tmp_path, capsys):
    """Issue 40, found by a tester: a Parquet table of no column was replaced by a one-row ledger, and ``{fix: [1, 2]
    (int), row_id, evil}`` merged (``evil`` kept, ``fix`` cast to text), exit 0. Each is bad input (exit 2) naming
    what is wrong, the file left byte for byte, the new measurement kept in its folder -- through the API and
    `measure --run-dir` against a fake server; a ledger this tool wrote keeps taking rows."""
    import pyarrow as pa

    cases = {
        "no_column": (pa.table({}), "a table of no column (0 rows, not written by this tool)"),
        "fix_int": (pa.table({"fix": [1, 2], "row_id": ["a", "b"], "evil": ["x", "y"]}),
                    "its column fix holds integers, not text"),
        "row_id_binary": (pa.table({"fix": ["a"], "row_id": pa.array([b"\x00"], pa.binary())}),
                          "its column row_id holds bytes, not text"),
        "nested": (pa.table({"fix": ["a"], "row_id": ["r"], "evil": pa.array([[1, 2]], pa.list_(pa.int64()))}),
                   "its column evil holds lists, a type this tool never writes"),
    }
    for name, (table, why) in cases.items():
        run, before = _foreign(tmp_path, name, table)
        with pytest.raises(LedgerUnreadable) as err:
            measured.record(run, "new")
        assert str(err.value).startswith(f"{run / 'ledger.parquet'}: the ledger cannot be read (a Parquet table of "
                                         f"another shape: {why}"), (name, str(err.value))
        assert err.value.exit_code == 2 and "kept in fixes/new" in str(err.value), name
        assert (run / "fixes" / "new" / "summary.json").exists(), name
        assert (run / "ledger.parquet").read_bytes() == before, name
    run, before = _foreign(tmp_path, "cli", cases["fix_int"][0])
    capsys.readouterr()
    with fake_server("ok") as url:
        rc = main(["measure", "--url", url, "--run-dir", str(run), "--label", "x", "--num-prompts", "2",
                   "--max-new-tokens", "4", "--warmup", "0", "--quiet", "--timeout", "60"])
    err_lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if "error" in ln and
                 not ln.startswith("warning:")]
    assert rc == 2 and len(err_lines) == 1 and "its column fix holds integers, not text" in err_lines[0], err_lines
    assert (run / "fixes" / "x" / "summary.json").exists() and (run / "ledger.parquet").read_bytes() == before
    # a ledger of this tool with every kind of column it writes (text, ints, floats, booleans, all-empty) still reads
    ok = tmp_path / "ok"
    measured.record(ok, "a", error=None)
    measured.record(ok, "b")
    assert list(Ledger(ok / "ledger.parquet").read()["fix"]) == ["a", "b"]
