"""investigate's attach step says which capture path it cannot vouch for when a GPU server of the DeepSeek family runs
two-batch overlap, DP attention, EP all-to-all or CUDA graphs (none of which the CPU reference can run): an unverified
capture path is a caveat, never silence. Fake /server_info answers, no server."""
from __future__ import annotations

import json

import pytest

from helpers.investigation.attach import attach, capture_caveats

#: what SGLang 0.5.23's /server_info says of these features on a plain CPU reference server (read from a live one)
CPU = {"device": "cpu", "disable_cuda_graph": True, "enable_two_batch_overlap": False, "enable_dp_attention": False,
       "attn_dp_size": 1, "moe_a2a_backend": "none", "ep_size": 1,
       "cuda_graph_config": {"decode": {"backend": "disabled"}, "prefill": {"backend": "disabled"}}}
GPU = {**CPU, "device": "cuda", "disable_cuda_graph": False,
       "cuda_graph_config": {"decode": {"backend": "full"}, "prefill": {"backend": "disabled"}}}
DS = (["DeepseekV3ForCausalLM"], "deepseek_v3")


class _Client:
    url = "http://127.0.0.1:9"

    def __init__(self, info):
        self.info = info

    def server_info(self):
        return dict(self.info)


def _target(tmp_path, archs=("DeepseekV3ForCausalLM",), model_type="deepseek_v3"):
    d = tmp_path / "target"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": list(archs), "model_type": model_type,
                                               "hidden_size": 128, "num_hidden_layers": 8, "vocab_size": 4096}))
    return d


def test_a_cpu_reference_server_has_no_caveat():
    assert capture_caveats(CPU, *DS) == []


@pytest.mark.parametrize("change,path,cites", [
    ({"enable_two_batch_overlap": True}, "two-batch overlap", "deepseek_v2.py:3166-3173"),
    ({"enable_dp_attention": True, "attn_dp_size": 4, "tp_size": 8}, "DP attention", "stage.py:461-480"),
    ({"attn_dp_size": 2, "tp_size": 8}, "DP attention", "attn_tp_gather_input"),
    ({"enable_dp_attention": True, "dp_size": 2, "tp_size": 8}, "DP attention", "boundary.py:582-614"),
    ({"moe_a2a_backend": "deepep", "ep_size": 8}, "expert parallelism", "forward_deepep"),
    ({"ep_size": 8}, "expert parallelism", "fused_moe_native.py:77"),
])
def test_each_feature_names_its_unverified_capture_path(change, path, cites):
    notes = capture_caveats({**CPU, **change}, *DS)
    assert len(notes) == 1 and path in notes[0] and cites in notes[0]
    assert notes[0].startswith("unverified capture path on this DeepSeek-family server")


def test_cuda_graphs_on_a_gpu_server_and_all_at_once():
    assert [n for n in capture_caveats(GPU, *DS) if "CUDA graphs" in n and "--disable-cuda-graph" in n]
    # a GPU server started with --disable-cuda-graph (e.g. env/gpu/launch_tp8.sh with LAYERS_DIR): no graph caveat
    assert capture_caveats({**GPU, "disable_cuda_graph": True}, *DS) == []
    # DP attention with one attention-TP rank per DP group (attn_dp_size == tp_size) was served on the CPU reference
    assert capture_caveats({**CPU, "enable_dp_attention": True, "attn_dp_size": 2, "tp_size": 2}, *DS) == []
    everything = {**GPU, "enable_two_batch_overlap": True, "enable_dp_attention": True, "attn_dp_size": 2,
                  "tp_size": 8, "moe_a2a_backend": "deepep", "ep_size": 8}
    assert len(capture_caveats(everything, *DS)) == 4
    # Kimi-K2.5 builds DeepSeek-V3 inside; the same caveats
    assert len(capture_caveats(everything, ["KimiK25ForConditionalGeneration"], "kimi_k25")) == 4
    # another family: its capture path is not DeepSeek's packer / stage boundaries; nothing claimed here
    assert capture_caveats(everything, ["LlamaForCausalLM"], "llama") == []


def test_odd_server_info_values_do_not_crash_or_invent_caveats():
    assert capture_caveats({**CPU, "attn_dp_size": None, "ep_size": "8", "moe_a2a_backend": None}, *DS) == []
    assert capture_caveats({}, *DS) != []          # nothing said: not CPU, graphs not disabled -> the graph caveat


def test_attach_carries_the_caveats(tmp_path):
    info = {**GPU, "version": "0.5.23", "tp_size": 8, "speculative_algorithm": "EAGLE3", "model_path": "/gpu/Kimi",
            "enable_two_batch_overlap": True}
    att = attach(_Client(info), target=_target(tmp_path))
    assert len(att.caveats) == 2
    assert any("two-batch overlap" in c for c in att.caveats) and any("CUDA graphs" in c for c in att.caveats)
    assert att.to_json()["caveats"] == att.caveats
    (tmp_path / "llama").mkdir()
    llama = attach(_Client(info), target=_target(tmp_path / "llama", ("LlamaForCausalLM",), "llama"))
    assert llama.caveats == []
