"""The xdist work units of ``make test`` (tests/conftest.py): the server, notebook and environment tiers stay one unit
on one worker, in collection order; each unit test is its own unit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import serial_scope

ROOT = Path(__file__).resolve().parents[2]


def test_server_suite_and_env_tests_share_one_unit_and_unit_tests_do_not():
    assert serial_scope("tests/server/test_cases.py::test_x[a]") == "serial"
    assert serial_scope("tests/suite/test_suite.py::test_y") == "serial"
    assert serial_scope("tests/env/test_reference_models.py::test_z") == "serial"
    unit = "tests/unit/draft/test_mla.py::test_w"
    assert serial_scope(unit) == unit
    assert serial_scope("tests/unit/test_server_pure.py::test_v") != "serial"   # a name, not a tier


def test_under_xdist_the_server_tier_runs_on_one_worker(tmp_path):
    """Two workers, three cheap tests of two serial tiers (no server starts) beside a unit module: each test's worker
    read from the ``-v`` lines."""
    tests = ["tests/unit/test_kinds.py", "tests/server/test_reference_server.py::test_cpu_bind_spec",
             "tests/env/test_kimi_models.py::test_kimi_llama_style_draft_follows_sglang_llama_eagle3",
             "tests/env/test_kimi_models.py::test_mla_expanded_attention_equals_sglangs_absorbed_form"]
    out = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", *tests],
                         cwd=ROOT, capture_output=True, text=True, timeout=300).stdout
    workers = {}
    for line in out.splitlines():
        if line.startswith("[gw") and " PASSED " in line:
            workers[line.split(" PASSED ")[1].strip()] = line[1:4]
    serial = {w for t, w in workers.items() if not t.startswith("tests/unit/")}
    assert len([t for t in workers if not t.startswith("tests/unit/")]) == 3, out[-2000:]
    assert len(serial) == 1 and len(set(workers.values())) == 2, workers
