"""A Kimi-class target (DeepSeek-V3: MLA, routed experts + a shared expert, noaux_tc router) on the embedded SGLang
0.5.23 CPU server with either EAGLE-3 draft, against HF transformers on the same weights (fp32).

One server per class (class-scoped, so only one runs at a time): TP 2 with the MLA draft (``Eagle3DeepseekV2ForCausalLM``)
and the capture hooks; TP 2 with the Llama draft (``LlamaForCausalLMEagle3``), DP attention and a fault injected on the
packed aux tensor; TP 8 (slow: where 8 ranks matter) with the MLA draft and the embedding among its ids. Each checks the SGLang
rule table's prediction for its draft's ids against what the server really feeds the draft
(``helpers.diagnosis.conventions.served_plan``: first id 1 -> +1; first id 2 -> capture indices as-is; -1 with first
id 1 -> the embedding), and two TP 1 starts check that an id the layer loop never reaches (the last layer, or -1
without first id 1) fails the server at its warm-up as predicted (RuntimeError in AuxHiddenStatePacker.finalize).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file

from helpers.capture import capture_every_layer, capture_served, every_layer_hook_specs
from helpers.diagnosis.conventions import served_plan
from helpers.diagnosis.diagnose import diagnose
from helpers.errors import ServerStartError
from helpers.formats.configs import read_draft_config, read_target_config
from helpers.formats.dumps import read_dump, write_dump
from helpers.hooks import ARM_FILE, DEEPSEEK, CaptureConfig, Fault, hook_specs, model_family
from helpers.server.embedded import start
from support.kimi import build_llama_draft, build_mla_draft, hf_layers, identify, rel_diff

pytestmark = pytest.mark.server

PROMPTS = [[5, 17, 300, 41, 9, 1000, 77, 23, 512, 64, 3, 2048], [901, 44, 7, 3100, 12, 88, 650, 9]]
NEW_TOKENS = 24
#: fp32 parity: SGLang's absorbed MLA and its per-rank sums vs HF's expanded attention, ~1e-6 measured
TOL = 1e-4


@pytest.fixture(scope="module")
def hf(kimi):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(kimi.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tcfg(kimi):
    return read_target_config(kimi.target)


def _server(target, draft, tp, hooks=None, **kw):
    t0 = time.monotonic()
    handle = start(target, draft, tp=tp, forward_hooks=hooks, timeout=1200, **kw)
    handle.startup_s = time.monotonic() - t0
    print(f"\n[kimi] TP {tp} server with {json.loads((Path(draft) / 'config.json').read_text())['architectures'][0]} "
          f"ready in {handle.startup_s:.1f} s")
    return handle


def _stop(handle):
    pids = [p.pid for p in handle.processes()]
    handle.stop()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"processes of the server survived stop(): {alive}"


def _generate(url, ids, n=NEW_TOKENS, hidden=False):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    if hidden:
        body["return_hidden_states"] = True
    r = httpx.post(url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    return r.json()


def _hf_greedy(model, ids, n=NEW_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=2)
    return out[0, len(ids):].tolist()


def _assert_greedy_equal(url, hf, prompts, n=NEW_TOKENS) -> float:
    """Served greedy tokens == HF's for each prompt; returns the accept length over them (tokens per verify step)."""
    tokens = steps = 0
    for ids in prompts:
        out = _generate(url, ids, n)
        served, ref = out["output_ids"], _hf_greedy(hf, ids, n)
        first = next((i for i, (a, b) in enumerate(zip(served, ref)) if a != b), None)
        assert first is None, f"prompt {ids[:4]}...: served and HF greedy tokens part at position {first}: " \
                              f"{served[first:first + 4]} vs {ref[first:first + 4]}"
        tokens += out["meta_info"]["completion_tokens"]
        steps += out["meta_info"]["spec_verify_ct"]
    return tokens / max(steps, 1)


def _listeners(pid):
    root = psutil.Process(pid)
    pids = {p.pid for p in [root] + root.children(recursive=True)}
    return [(c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def _assert_loopback_only(handle):
    socks = _listeners(handle.pid)
    assert (("127.0.0.1", handle.port) in socks), socks
    assert all(ip == "127.0.0.1" for ip, _ in socks), f"listeners off 127.0.0.1: {socks}"


def _served_aux(url, ids, n=4):
    """The aux hidden states the server fed the draft for ``ids`` + its greedy continuation: ([T, W], sequence)."""
    assert httpx.post(url + "/flush_cache", timeout=60).status_code == 200
    out = _generate(url, ids, n, hidden=True)
    hs = out["meta_info"]["hidden_states"]
    return torch.tensor(hs[0] + hs[1:]), ids + out["output_ids"][:-1]


def _assert_table_predicts(url, hf, draft, tcfg, *, after=lambda tensors: tensors):
    """The chunks the server feeds the draft are the table's plan for this draft's ids (``after``: a fault's effect)."""
    plan = served_plan(read_draft_config(draft), tcfg, version="0.5.23")
    assert plan.fatal is None, plan.fatal
    served, seq = _served_aux(url, PROMPTS[0])
    layers = hf_layers(hf, seq)
    h = tcfg.hidden_size
    got = [identify(served[:, c * h:(c + 1) * h], layers) for c in range(served.shape[1] // h)]
    assert [name for name, _ in got] == after(plan.tensors), (got, plan.engine_ids)
    assert max(r for _, r in got) < TOL, got
    return plan, got


def _arm(folder: Path):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ARM_FILE).write_text("armed by the test\n")


def _rank_forward(folder: Path, rank: int, ids) -> dict:
    """The tensors rank ``rank`` recorded for the forward whose input is exactly ``ids`` (the prefill)."""
    for line in (folder / f"rank{rank}" / "index.jsonl").read_text().splitlines():
        rec = json.loads(line)
        t = load_file(str(folder / f"rank{rank}" / rec["file"]))
        if t["input_ids"].tolist() == list(ids):
            return t
    raise AssertionError(f"rank {rank} recorded no forward of {list(ids)[:4]}...")


def _assert_moe_partials(folder: Path, tp: int, hf, n_layers: int, first_dense: int):
    """Per-rank capture hooks on the MoE layers: each rank's ``mlp_partial(L)`` (the mlp module's output before the
    all-reduce) is one of ``tp`` different shards whose sum is HF's MoE block output; ``resid_mid(L)`` is replicated."""
    ids = PROMPTS[1]
    ranks = [_rank_forward(folder, r, ids) for r in range(tp)]
    layers = hf_layers(hf, ids)
    worst = 0.0
    for L in range(first_dense, n_layers):
        parts = [r[f"mlp_partial({L})"] for r in ranks]
        total = rel_diff(sum(parts), layers[f"mlp({L})"])
        worst = max(worst, total)
        assert total < TOL, (L, total)
        assert min(rel_diff(p, layers[f"mlp({L})"]) for p in parts) > 0.05, f"layer {L}: one rank holds the sum"
        assert all(torch.equal(r[f"resid_mid({L})"], ranks[0][f"resid_mid({L})"]) for r in ranks)
    torch.testing.assert_close(sum(r["embedding_local"] for r in ranks), ranks[0]["embedding"], atol=1e-6, rtol=0)
    return worst


def _capture_hooks(n, ranks: Path, layers: Path | None, faults=()):
    keys = ["embedding", "embedding_local"] + [f"mlp_partial({L})" for L in range(n)] + \
           [f"resid_mid({L})" for L in range(n)]
    specs = hook_specs(list(faults), CaptureConfig(out_dir=str(ranks), keys=keys, armed_by_file=True),
                       num_layers=n, family=DEEPSEEK)
    if layers is not None:
        specs += every_layer_hook_specs(layers, n, DEEPSEEK)
    seen, out = set(), []
    for s in specs:
        if s["name"] not in seen:
            seen.add(s["name"])
            out.append(s)
    return out


# ---------------------------------------------------------------------------------------------- TP 2, MLA draft
@pytest.fixture(scope="class")
def mla_tp2(kimi, tcfg, tmp_path_factory):
    assert model_family(tcfg.architectures, tcfg.model_type) is DEEPSEEK
    cap = tmp_path_factory.mktemp("kimi-mla-tp2")
    handle = _server(kimi.target, kimi.mla_draft, 2, _capture_hooks(tcfg.num_hidden_layers, cap / "ranks",
                                                                    cap / "layers"))
    handle.cap = cap
    yield handle
    _stop(handle)


class TestMLADraftTP2:
    def test_greedy_tokens_equal_hf(self, mla_tp2, hf, kimi):
        accept = _assert_greedy_equal(mla_tp2.url, hf, PROMPTS)
        info = httpx.get(mla_tp2.url + "/server_info", timeout=60).json()
        assert info["tp_size"] == 2 and info["speculative_algorithm"] == "EAGLE3"
        print(f"[kimi] TP 2 MLA draft ({'trained' if kimi.trained else 'random'}): accept length {accept:.2f}")
        if kimi.trained:     # the trained MLA draft, fed its training layers, proposes tokens the target accepts
            assert accept > 1.3, accept

    def test_every_listener_on_loopback(self, mla_tp2):
        _assert_loopback_only(mla_tp2)

    def test_packed_aux_is_hf_at_the_trained_layers_as_the_table_says(self, mla_tp2, hf, kimi, tcfg):
        """ids [1, 3, 4] (first id 1): +1 -> capture indices [2, 4, 5] = out(1), out(3), out(4), packed in one
        [T, 3H] tensor (AuxHiddenStatePacker)."""
        plan, got = _assert_table_predicts(mla_tp2.url, hf, kimi.mla_draft, tcfg)
        assert list(plan.engine_ids.ids) == [i + 1 for i in plan.config_ids.ids] and plan.config_ids.ids[0] == 1
        print(f"[kimi] TP 2 served chunks vs HF: {[(n, f'{r:.1e}') for n, r in got]}")

    def test_every_layer_capture_and_the_diagnosis_identify_each_layer(self, mla_tp2, hf, kimi, tcfg, tmp_path):
        """The server's own every-layer reference (capture --every-layer) equals HF layer by layer, and the diagnosis,
        given it, names every served chunk's layer and finds no fault against training data taken from HF."""
        n, h = tcfg.num_hidden_layers, tcfg.hidden_size
        ref = capture_every_layer(mla_tp2.url, PROMPTS, mla_tp2.cap / "layers", tmp_path, num_layers=n,
                                  progress=False)
        dump = read_dump(ref)
        names = dump.layer_plan["tensors"]
        assert names == ["embedding"] + [f"out({L})" for L in range(n)]
        parity = {}
        for s in dump.samples:
            layers = hf_layers(hf, [int(x) for x in s.input_ids])
            hidden = s.load()
            for c, name in enumerate(names):
                parity[name] = max(parity.get(name, 0.0), rel_diff(hidden[:, c * h:(c + 1) * h], layers[name]))
        assert max(parity.values()) < TOL, parity
        print(f"[kimi] every-layer parity (server's hooks vs HF, max rel diff): "
              f"{ {k: float(f'{v:.1e}') for k, v in parity.items()} }")
        served = capture_served(mla_tp2.url, PROMPTS, tmp_path, name="served", progress=False)
        trained = [1, 3, 4]
        samples = []
        for i, ids in enumerate(PROMPTS):
            layers = hf_layers(hf, ids)
            samples.append({"key": f"s{i}", "input_ids": torch.tensor(ids),
                            "hidden": torch.cat([layers[f"out({L})"] for L in trained], dim=-1)})
        training = write_dump(tmp_path / "training", samples,
                              {"kind": "training", "layer_plan": {"tensors": [f"out({L})" for L in trained]},
                               "hidden_size": h})
        diag = diagnose(training, [served], draft_config=kimi.mla_draft, target_config=kimi.target, reference=ref)
        assert diag.findings == [], diag.findings
        assert [c["identified_as"] for c in diag.chunks] == ["out(1)", "out(3)", "out(4)"]
        assert [c["matched_training_chunk"] for c in diag.chunks] == [0, 1, 2]

    def test_per_rank_capture_hooks_on_moe_layers(self, mla_tp2, hf, tcfg):
        ranks = mla_tp2.cap / "ranks"
        _arm(ranks)
        try:
            assert httpx.post(mla_tp2.url + "/flush_cache", timeout=60).status_code == 200
            _generate(mla_tp2.url, PROMPTS[1], 2)
        finally:
            (ranks / ARM_FILE).unlink()
        worst = _assert_moe_partials(ranks, 2, hf, tcfg.num_hidden_layers, tcfg.raw["first_k_dense_replace"])
        print(f"[kimi] TP 2 MoE partials summed over ranks vs HF: max rel diff {worst:.1e}")


# ---------------------------------------------------------------------------------------------- TP 2, Llama draft
@pytest.fixture(scope="class")
def llama_tp2(kimi, tcfg, tmp_path_factory):
    """The Llama draft with ids [2, 4, 5] (DeepSeek: capture indices as-is), a chunk_order fault the tool's hook
    applies to the packed aux tensor, and DP attention (``--attn-dp-size 2``: one attention-TP rank per DP group, the
    DP-attention case the CPU reference can run)."""
    d = build_llama_draft(tmp_path_factory.mktemp("kimi-llama") / "draft", kimi.target, layer_ids=[2, 4, 5])
    if kimi.trained:      # the trained Llama draft's weights with these ids (fc width is the same)
        import shutil
        shutil.copy(kimi.llama_draft / "model.safetensors", d / "model.safetensors")
    cap = tmp_path_factory.mktemp("kimi-llama-tp2")
    hooks = _capture_hooks(tcfg.num_hidden_layers, cap / "ranks", None,
                           faults=[Fault("chunk_order", order=[2, 0, 1])])
    handle = _server(kimi.target, d, 2, hooks, extra_args=["--attn-dp-size", "2"])
    handle.draft_dir = d
    yield handle
    _stop(handle)


class TestLlamaDraftTP2:
    def test_greedy_tokens_equal_hf_under_dp_attention(self, llama_tp2, hf):
        info = httpx.get(llama_tp2.url + "/server_info", timeout=60).json()
        assert info["enable_dp_attention"] is True and info["attn_dp_size"] == 2
        _assert_greedy_equal(llama_tp2.url, hf, PROMPTS[:1])
        _assert_loopback_only(llama_tp2)

    def test_capture_index_ids_as_is_and_the_fault_on_the_packed_tensor(self, llama_tp2, hf, tcfg):
        """ids [2, 4, 5]: no +1 (first id is not 1) -> out(1), out(3), out(4); the fault hook reordered the packed
        [T, 3H] tensor to chunks 2, 0, 1 before the draft (and return_hidden_states) saw it."""
        plan, got = _assert_table_predicts(llama_tp2.url, hf, llama_tp2.draft_dir, tcfg,
                                           after=lambda t: [t[2], t[0], t[1]])
        assert list(plan.engine_ids.ids) == [2, 4, 5]


# ---------------------------------------------------------------------------------------------- TP 8, MLA draft
@pytest.fixture(scope="class")
def tp8(kimi, tcfg, tmp_path_factory):
    """The MLA draft with ids [1, 3, -1]: +1 -> [2, 4, 0], the embedding (all-reduced over 8 vocab shards) first."""
    d = build_mla_draft(tmp_path_factory.mktemp("kimi-tp8") / "draft", kimi.target, layer_ids=[1, 3, -1])
    cap = tmp_path_factory.mktemp("kimi-tp8-cap")
    handle = _server(kimi.target, d, 8, _capture_hooks(tcfg.num_hidden_layers, cap / "ranks", None))
    handle.draft_dir, handle.cap = d, cap
    yield handle
    _stop(handle)


@pytest.mark.slow
class TestTP8:
    def test_tp8_tokens_table_moe_ranks_and_listeners(self, tp8, hf, tcfg):
        _assert_greedy_equal(tp8.url, hf, PROMPTS[:1], n=12)
        _assert_loopback_only(tp8)
        plan, got = _assert_table_predicts(tp8.url, hf, tp8.draft_dir, tcfg)
        assert plan.tensors == ["embedding", "out(1)", "out(3)"]
        ranks = tp8.cap / "ranks"
        _arm(ranks)
        try:
            assert httpx.post(tp8.url + "/flush_cache", timeout=60).status_code == 200
            _generate(tp8.url, PROMPTS[1], 1)
        finally:
            (ranks / ARM_FILE).unlink()
        worst = _assert_moe_partials(ranks, 8, hf, tcfg.num_hidden_layers, tcfg.raw["first_k_dense_replace"])
        print(f"[kimi] TP 8 MoE partials summed over 8 ranks vs HF: max rel diff {worst:.1e}")


# ---------------------------------------------------------------------------------------------- unreached ids, TP 1
@pytest.mark.parametrize("ids", [[1, 3, 7], [2, 4, -1]], ids=["last-layer", "minus-1-without-first-id-1"])
def test_an_unreached_id_fails_the_warm_up_as_the_table_predicts(ids, kimi, tcfg, tmp_path):
    """The DeepSeek family packs its captures: capture index 8 (the last layer's output, id 7 under +1) or -1 (ids
    used as-is) is never reached, so AuxHiddenStatePacker.finalize raises at the first forward, SGLang's warm-up: the
    server never becomes healthy. Not a silently missing chunk."""
    d = build_mla_draft(tmp_path / "draft", kimi.target, layer_ids=ids)
    plan = served_plan(read_draft_config(d), tcfg, version="0.5.23")
    assert plan.fatal and "RuntimeError 'captured 2 of 3 aux hidden states'" in plan.fatal
    with pytest.raises(ServerStartError) as err:
        start(kimi.target, d, tp=1, timeout=900, log_path=tmp_path / "server.log")
    assert "RuntimeError: captured 2 of 3 aux hidden states" in str(err.value)


# ------------------------------------------------------------------- TP 2, the target's own NextN / MTP head
@pytest.fixture(scope="class")
def nextn_tp2(kimi):
    """SGLang's NEXTN with no draft folder: the draft is the target's extra layer model.layers.8.*
    (arg_groups/speculative_hook.py::handle_speculative_decoding sets the draft path to the target's;
    configs/model_config.py makes it DeepseekV3ForCausalLMNextN), 1 step, topk 1, 2 draft tokens."""
    from helpers.server.settings import SpecSettings
    if json.loads((Path(kimi.target) / "config.json").read_text()).get("num_nextn_predict_layers") != 1 or \
            not (Path(kimi.target) / "nextn_training_log.json").is_file():
        pytest.skip("the Kimi-class target has no trained NextN layer here (env/models/train_nextn.py)")
    t0 = time.monotonic()
    handle = start(kimi.target, None, tp=2, spec=SpecSettings(algorithm="NEXTN", num_steps=1, topk=1,
                                                              num_draft_tokens=2), timeout=1200)
    print(f"\n[kimi] TP 2 NEXTN server (the target's NextN layer) ready in {time.monotonic() - t0:.1f} s")
    yield handle
    _stop(handle)


@pytest.mark.extended
class TestNextNTP2:
    def test_nextn_head_is_served_from_the_target_and_keeps_greedy_tokens(self, nextn_tp2, hf, kimi):
        """The server resolves NEXTN to EAGLE with the target folder as the draft path; its greedy tokens equal HF's
        (the target alone) and the trained head is accepted (accept length above 1: at least some of its token-t+2
        guesses verified)."""
        info = httpx.get(nextn_tp2.url + "/server_info", timeout=60).json()
        assert info["speculative_algorithm"] == "EAGLE"
        assert Path(info["speculative_draft_model_path"]).resolve() == Path(kimi.target).resolve()
        assert (info["speculative_num_steps"], info["speculative_num_draft_tokens"]) == (1, 2)
        accept = _assert_greedy_equal(nextn_tp2.url, hf, PROMPTS)
        print(f"[kimi] NEXTN TP 2 steps 1: accept length {accept:.3f} over {len(PROMPTS)} prompts")
        assert accept > 1.2

    def test_investigate_runs_on_the_nextn_head(self, nextn_tp2, kimi, tmp_path):
        """``investigate`` on the NEXTN server (helpers.investigation.mtp): the state the head is fed is identified
        per token as the target's final hidden state after its final norm (HF every-layer reference of the same
        tokens), the head run offline on it equals the live counters of the same answers (engine loss 0, paired),
        and the clean server is never a fault: the draft stage finds the rows of the head's training log (its
        validation_rows, relocated into this checkout) and clears the head; the verdict is ok when the 4 prompts also
        clear wiring and engine (below 10 prompts only an exact identity clears), else undecided."""
        from helpers.investigation.live import investigate
        from helpers.investigation.mtp import POST_NORM
        t0 = time.monotonic()
        doc = investigate(nextn_tp2.url, training=None, run_dir=tmp_path / "run", measure_prompts=4,
                          max_new_tokens=16, timeout=900, apply_fix=False, engine_probes="none")
        print(f"[kimi] investigate on the NEXTN TP 2 server: {time.monotonic() - t0:.1f} s; {doc.sentence}")
        ident = doc.diagnosis["served_state"]
        assert ident["identified"] == POST_NORM and ident["rel_error"][POST_NORM] < 1e-4
        assert ident["rel_error"]["out(7)"] > 0.3 and ident["sequences"] == 4
        assert doc.findings == [] and doc.error is None
        assert doc.acceptance["losses"]["draft"]["decision"] == "clear" and doc.acceptance["draft_stage"]["same_rows"]
        assert doc.verdict == ("ok" if doc.acceptance["cause"] == "none" else "undecided")
        b = doc.acceptance
        assert [s["name"] for s in b["stages"]] == ["checkpoint (teacher-forced)", "draft (offline, reference states)",
                                                    "wiring (offline, served states)", "live"]
        # TP 2 sums in another order than HF / the offline head: a near-tie may flip one draft token, never a loss
        for stage in ("wiring", "engine"):
            assert abs(b["losses"][stage]["delta"]) <= 0.05 and b["losses"][stage]["decision"] != "counts"
        assert b["stages"][3]["accept_length"] > 1.0 and b["cause"] in ("none", "undecided")
