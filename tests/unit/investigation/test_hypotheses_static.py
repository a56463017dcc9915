"""The static wiring check needs no server: it compares what the configured engine will feed with
what the training data records it was captured with (env/models/data/sample/capture.json), so a
draft config edited after training (ids written in the vLLM convention) is caught."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.errors import BadInput
from helpers.investigation.checks import run_check
from helpers.investigation.inputs import Investigation
from helpers.investigation.propose import draft_variant
from helpers.formats.training_data import recorded_layer_ids
from support import ROOT

MODELS = ROOT / "env" / "models"
pytestmark = pytest.mark.skipif(not (MODELS / "draft" / "config.json").exists(),
                                reason="reference models (env/models) not built")


def _inv(tmp_path: Path, draft: Path, training: Path) -> Investigation:
    return Investigation(tmp_path / "run", None, training=training, draft_dir=draft,
                         target_dir=MODELS / "target", reference=None)


def test_recorded_ids_are_the_manifest_ones():
    ids, path = recorded_layer_ids(MODELS / "data" / "sample")
    manifest = json.loads((MODELS / "data" / "sample" / "capture.json").read_text())
    assert ids == manifest["layer_ids"]["specforge_out_i"] == [1, 3, 4]
    assert path.name == "capture.json"
    # from a file two levels down too
    ckpt = next((MODELS / "data" / "sample").rglob("data_0.ckpt"))
    assert recorded_layer_ids(ckpt)[0] == [1, 3, 4]


def test_bad_manifest_names_file_and_field(tmp_path):
    (tmp_path / "capture.json").write_text(json.dumps({"layer_ids": {"specforge_out_i": "1,3,4"}}))
    with pytest.raises(BadInput, match=r"capture\.json.*layer_ids\.specforge_out_i"):
        recorded_layer_ids(tmp_path)
    (tmp_path / "capture.json").write_text("{not json")
    with pytest.raises(BadInput, match="capture.json"):
        recorded_layer_ids(tmp_path)


def test_edited_config_is_caught_from_the_training_manifest(tmp_path):
    edited = draft_variant(MODELS / "draft", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}},
                           tmp_path / "draft")
    res = run_check("static_wiring", _inv(tmp_path, edited, MODELS / "data" / "sample"))
    assert res.verdict == "confirmed", res.explanation
    assert res.data["served_plan"] == ["out(2)", "out(4)", "out(5)"]
    assert res.data["training_plan"] == ["out(1)", "out(3)", "out(4)"]
    assert "capture.json" in res.data["trained_ids_source"]


def test_shipped_config_agrees(tmp_path):
    res = run_check("static_wiring", _inv(tmp_path, MODELS / "draft", MODELS / "data" / "sample"))
    assert res.verdict == "refuted", res.explanation
    assert res.data["served_plan"] == res.data["training_plan"] == ["out(1)", "out(3)", "out(4)"]


def test_without_manifest_the_param_decides(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(MODELS / "data" / "sample", data)
    (data / "capture.json").unlink()
    edited = draft_variant(MODELS / "draft", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}},
                           tmp_path / "draft")
    # no manifest: the config is all there is, and it agrees with itself
    assert run_check("static_wiring", _inv(tmp_path, edited, data)).verdict == "refuted"
    # the run YAML's ids, given as the check's param, expose the edit
    res = run_check("static_wiring", _inv(tmp_path, edited, data), params={"trained_layer_ids": [1, 3, 4]})
    assert res.verdict == "confirmed" and "given by the caller" in res.data["trained_ids_source"]


def test_chunk_layer_figure_places_the_embedding_at_minus_one():
    import pandas as pd

    from helpers.plots.checks import chunk_layer_figure as _chunk_layer_figure

    frame = pd.DataFrame({"chunk": [0, 1, 2], "trained": ["out(1)", "out(3)", "out(4)"],
                          "configured": ["embedding", "out(1)", "out(3)"],
                          "measured (reference)": ["embedding", "out(1)", None]})
    fig = _chunk_layer_figure(frame, "t", with_configured=True)
    ys = {t.name: list(t.y) for t in fig.data}
    assert ys == {"trained on": [1, 3, 4], "configured (engine plan)": [-1, 1, 3],
                  "served (measured)": [-1, 1, None]}
    assert [t.name for t in _chunk_layer_figure(frame, "t").data] == ["trained on", "served (measured)"]
