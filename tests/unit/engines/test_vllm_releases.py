"""vLLM's EAGLE-3 rules per release (helpers/layers/vllm.py gates, read in the PyPI sdists 0.10.0 - 0.31.0; table
helpers/layers/data/vllm-eagle3-releases.json) on recorded draft config dicts. No server."""
from __future__ import annotations

import json

import pytest

from helpers.layers import vllm as rules

#: a draft config with ids in three places (top level absent): eagle_config, dflash_config
NESTED = {"architectures": ["LlamaForCausalLMEagle3"],
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]},
          "dflash_config": {"target_layer_ids": [0, 5, 9]}}
TOP = {"eagle_aux_hidden_state_layer_ids": [28, 1, 15, 15]}


def test_known_versions_are_the_minors_read_whole_and_patches_are_refused():
    assert rules.is_known("0.22.0") and rules.is_known("0.31.0") and rules.is_known("0.32.0+cpu")
    assert not rules.is_known("0.21.0") and not rules.is_known("0.31.1") and not rules.is_known("0.15.0")
    assert rules.is_known("0.27.1") and not rules.is_known("0.20.2")          # a patch read, one read only in part
    assert rules.known_versions_text() == ("0.32.0, 0.22.0-0.31.0 (each minor's first release; patches 0.22.1, "
                                           "0.25.1, 0.27.1)")


def test_config_ids_source_per_release():
    n = 32
    assert rules.aux_layer_ids(NESTED, n) == rules.aux_layer_ids(NESTED, n, "0.22.0") \
        == ((1, 15, 28), "draft config eagle_config.eagle_aux_hidden_state_layer_ids")
    # 0.20 / 0.21: dflash ids verbatim, eagle_config not read
    assert rules.aux_layer_ids(NESTED, n, "0.21.0") == ((0, 5, 9), "draft config dflash_config.target_layer_ids")
    # 0.22+: dflash +1 when eagle_config is absent
    dfl = {"dflash_config": {"target_layer_ids": [0, 5, 9]}}
    assert rules.aux_layer_ids(dfl, n, "0.30.0") == ((1, 6, 10), "draft config dflash_config.target_layer_ids (+1)")
    # 0.12 - 0.19: top level only; nested ids fall to the default
    assert rules.aux_layer_ids(NESTED, n, "0.19.0") == ((2, 16, 29), "default (2, n//2, n-3)")
    assert rules.aux_layer_ids(TOP, n, "0.12.0") == ((1, 15, 28), "draft config eagle_aux_hidden_state_layer_ids")
    # 0.10 / 0.11.0: the draft config is never read; the patch 0.11.1 reads the top-level ids
    assert rules.aux_layer_ids(TOP, n, "0.11.0") == ((2, 16, 29), "default (2, n//2, n-3)")
    assert rules.aux_layer_ids(TOP, n, "0.11.1")[0] == (1, 15, 28)
    assert rules.aux_layer_ids(NESTED, n, "0.20.2")[0] == (0, 5, 9)
    assert rules.aux_layer_ids({}, 8, "0.10.0")[0] == (2, 4, 5)


def test_unread_release_is_refused_in_one_line():
    for v in ("0.15.0", "0.31.2", "0.9.2", "0.33.0", "0.21.1"):
        with pytest.raises(ValueError) as e:
            rules.aux_layer_ids(TOP, 32, v)
        assert "\n" not in str(e.value) and v in str(e.value)


def test_capture_at_id_0_and_n_before_and_since_0_18():
    assert rules.captured([0, 4, 8], 8, "0.18.0") == ["embedding", "out(3)", "out(7)"] == rules.captured([0, 4, 8], 8)
    assert rules.captured([1, 4, 8], 8, "0.17.0") == ["out(0)", "out(3)", None]
    with pytest.raises(ValueError, match="TypeError"):
        rules.captured([0, 4], 8, "0.16.0")


def test_use_aux_read_from_0_12():
    off = {"eagle_config": {"use_aux_hidden_state": False}}
    assert rules.use_aux_hidden_state(off) is False and rules.use_aux_hidden_state(off, "0.12.0") is False
    assert rules.use_aux_hidden_state(off, "0.11.0") is True and rules.use_aux_hidden_state(off, "0.11.2") is True


def test_embedding_width_check_since_0_25_and_gates_of_weight_rules():
    names = ["model.embed_tokens.weight", "fc.weight"]
    assert rules.weight_sharing(names, embed_equal=True, lm_head_equal=None, embed_width_equal=False,
                                version="0.25.0")["embedding"] == "draft"
    assert rules.weight_sharing(names, embed_equal=True, lm_head_equal=None, embed_width_equal=False,
                                version="0.24.0")["embedding"] == "target"
    assert rules.weight_sharing(["fc.weight"], version="0.16.0") == {"embedding": "target", "lm_head": "target"}
    with pytest.raises(ValueError, match="0.16.0"):
        rules.weight_sharing(names, version="0.14.0")
    assert rules.d2t_rule(["fc.weight"], 32, 128, "0.18.0") == "zeros"
    with pytest.raises(ValueError, match="0.18.0"):
        rules.d2t_rule(["d2t"], 32, 128, "0.17.0")
    assert rules.num_aux_hidden_states({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "0.22.0") == 2
    with pytest.raises(ValueError, match="0.22.0"):
        rules.num_aux_hidden_states({}, "0.21.0")


def test_table_ranges_match_the_gates():
    from pathlib import Path
    t = json.loads((Path(rules.__file__).parent / "data" / "vllm-eagle3-releases.json").read_text())
    read = {tuple(int(x) for x in v.split(".")[:3]) for v in t["releases_read"]}   # 0.10.1.1 reads as 0.10.1
    assert read == set(rules.READ_VERSIONS)
    starts = {r["changed_in"].split()[0] for r in t["rules"]["aux_ids"] if r.get("changed_in")}
    assert starts == {"0.11.1", "0.20.0", "0.22.0"}
    mech = {r["first"] for r in t["mechanical"]["aux_ids"] if r["items"]}
    assert mech == starts        # the digest changes are exactly the rule changes for aux ids
    assert [r["first"] for r in t["mechanical"]["aux_set"]][-1] == "0.30.0"


def test_served_plan_of_a_known_older_release_says_its_rule(tmp_path):
    """The reference h64 pair: 0.25.0 captures the same chunks as 0.32.0 but stores the ids verbatim."""
    import shutil
    from pathlib import Path
    from helpers.engines.vllm import VLLMRules
    from helpers.formats.configs import read_draft_config, read_target_config
    h64 = Path(__file__).resolve().parents[3] / "env" / "models" / "llama_h64"
    shutil.copytree(h64 / "draft", tmp_path / "draft")
    d, t = read_draft_config(tmp_path / "draft"), read_target_config(h64 / "target")
    new, old = VLLMRules("0.32.0").served_plan(d, t), VLLMRules("0.25.0").served_plan(d, t)
    assert new.tensors == old.tensors == ["out(0)", "out(2)", "out(3)"]
    assert any("sorted(set(ids))" in r for r in new.rules) and not any("sorted(set(ids))" in r for r in old.rules)
    assert any("kept verbatim" in r for r in old.rules) and "vLLM 0.25.0 rule" in old.source
