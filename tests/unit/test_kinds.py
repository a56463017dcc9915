"""The finding-kind registry (helpers/kinds.py) is the one declaration: records, detectors and checks agree."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from helpers import kinds as K
from helpers.diagnosis.detectors import finding
from helpers.investigation.catalog import CATALOG
from helpers.records import Finding


def test_every_kind_names_declared_checks_and_engine_fixes_match_their_fix():
    assert set(K.CHECK_FINDINGS) <= set(CATALOG)
    assert all((k.fix == "engine") == bool(k.engine_fix) for k in K.KINDS)
    assert set(K.LAYOUT_KINDS) <= K.ID_KINDS and set(K.LAYOUT_KINDS) <= K.TENSOR_KINDS


def test_undeclared_kind_is_refused_by_the_record_and_the_builder():
    with pytest.raises(ValidationError, match="unknown finding kind 'no_such_kind'"):
        Finding(kind="no_such_kind")
    with pytest.raises(ValueError, match="unknown finding kind"):
        finding("no_such_kind", None, "x")
    assert Finding(kind="layer_offset", chunk=None).kind == "layer_offset"


def test_report_order_sorts_whole_width_findings_first_within_a_kind():
    fs = [{"kind": "missing_chunk", "chunk": 1}, {"kind": "wrong_layer", "chunk": 2},
          {"kind": "wrong_layer", "chunk": None}, {"kind": "server_fatal", "chunk": None}]
    assert [(f["kind"], f["chunk"]) for f in K.sort_findings(fs)] == [
        ("server_fatal", None), ("wrong_layer", None), ("wrong_layer", 2), ("missing_chunk", 1)]
