"""The serving engine's loader rule table (``LoaderRules.TABLE``: SGLang 0.5.23's in helpers.draft.checks, vLLM
0.32.0's in helpers.engines.vllm_rules) decides which tensors the offline draft run uses, on the reference draft's real
tensors: a draft carrying an embed_tokens of its own runs with the target's embedding on SGLang and with its own on
vLLM, accepts fewer tokens offline the vLLM way, and the budget books that loss where the finding
``embedding_not_shared`` lives (the draft stage), not at the engine stage."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.draft import simulate as sm
from helpers.draft.budget import BudgetInputs, acceptance_budget, draft_cost, training_sequences
from helpers.draft.draft_stage import budget_fields, draft_rows
from helpers.draft.model import DraftArch, Eagle3Draft
from helpers.draft.training_log import read_training_log
from helpers.engines.detect import adapter
from helpers.errors import BadInput
from helpers.formats.configs import read_draft_config
from helpers.formats.training_data import TrainingData
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING, REFERENCE_VALIDATION
from support.drafts import damaged_draft, own_embedding_draft

SG, VL = adapter("sglang").loader_rules(None), adapter("vllm").loader_rules(None)
CHAIN = sm.DraftSettings.chain(3)


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    return own_embedding_draft(tmp_path_factory.mktemp("own") / "draft", target=REFERENCE_TARGET)


@pytest.fixture(scope="module")
def seqs():
    return training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))


def _al(draft, seqs) -> float:
    return sm.summary(sm.simulate_sequences(draft, seqs, [CHAIN])["per_request"][CHAIN], 3)["accept_length"]


def test_the_two_engines_run_an_own_embedding_differently_and_vllms_accepts_less(own, seqs):
    ref = Eagle3Draft.load(REFERENCE_DRAFT, REFERENCE_TARGET, loader=SG)
    sg = Eagle3Draft.load(own, REFERENCE_TARGET, loader=SG)
    vl = Eagle3Draft.load(own, REFERENCE_TARGET, loader=VL)
    mine = load_file(str(own / "model.safetensors"))["embed_tokens.weight"].float()
    assert torch.equal(sg.embed, ref.embed) and torch.equal(vl.embed, mine) and not torch.equal(sg.embed, vl.embed)
    assert sg.sources["embed"].startswith("target") and "SGLang uses it in place" in sg.sources["embed"]
    assert vl.sources["embed"].startswith("draft") and vl.sources["loader"].startswith("vLLM")
    a_ref, a_sg, a_vl = _al(ref, seqs), _al(sg, seqs), _al(vl, seqs)
    assert a_sg == a_ref                                   # SGLang: the own embedding is never read
    assert a_sg - a_vl > 0.5, (a_sg, a_vl)                 # vLLM runs the drifted copy
    # the default loader of an SGLang-layout draft is SGLang's
    assert Eagle3Draft.load(own, REFERENCE_TARGET).sources["loader"].startswith("SGLang")


def _fields(draft, draft_dir):
    tl = read_training_log(REFERENCE_DRAFT / "training_log.json")
    rows = draft_rows(draft, draft_dir=draft_dir, target_dir=REFERENCE_TARGET, training=REFERENCE_TRAINING,
                      hidden_size=128, log=tl, log_path=None, validation=REFERENCE_VALIDATION)
    return budget_fields(rows, tl)


def test_the_budget_books_vllms_own_embedding_at_the_draft_stage(own, seqs):
    """Served by vLLM (its live counters: the draft as vLLM's loader runs it, i.e. with its own embedding, on the
    same states), the offline run that follows vLLM's loader puts the loss in the draft stage and clears the engine
    stage; the offline run that used the target's embedding as SGLang would (before) booked it to the engine."""
    vl = Eagle3Draft.load(own, REFERENCE_TARGET, loader=VL)
    live = sm.simulate_sequences(vl, seqs, [CHAIN])["per_request"][CHAIN]
    cost, src = draft_cost(REFERENCE_DRAFT, REFERENCE_TARGET)
    docs = {}
    for name, loader in (("vllm", VL), ("sglang", SG)):
        d = Eagle3Draft.load(own, REFERENCE_TARGET, loader=loader)
        docs[name] = acceptance_budget(d, BudgetInputs(settings=CHAIN, **_fields(d, own), training=seqs,
                                                       live_sequences=seqs, live=live, draft_cost=cost,
                                                       draft_cost_source=src), required=("draft", "engine"))
    b, old = docs["vllm"], docs["sglang"]
    assert b["losses"]["draft"]["decision"] == "counts" and b["losses"]["draft"]["ci"][0] > 0.3, b["sentence"]
    assert b["losses"]["engine"]["decision"] != "counts" and abs(b["losses"]["engine"]["delta"]) < 0.05
    assert b["cause"] == "draft" and b["draft_sources"]["embed"].startswith("draft"), b["sentence"]
    assert old["losses"]["engine"]["decision"] == "counts" and old["losses"]["draft"]["decision"] != "counts"
    assert old["cause"] == "engine", old["sentence"]
    # the loss moves between the two stages, not in size
    assert abs(b["losses"]["draft"]["delta"] - old["losses"]["engine"]["delta"]) < 0.6


def _variant(tmp_path, name, edit, tensors=None):
    d = damaged_draft(tmp_path / name, tensors=())
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        w = load_file(str(d / "model.safetensors"))
        tensors(w)
        save_file(w, str(d / "model.safetensors"))
    return d


def test_every_loader_row_that_differs_between_the_engines(tmp_path, seqs):
    assert set(SG.TABLE) == set(VL.TABLE) == {"embedding", "lm_head", "d2t", "t2d", "norm_before_residual",
                                              "fc_norm"}
    # norms: norm_before_residual in an SGLang-layout config is read by vLLM only, and changes the draft's logits
    nbr = _variant(tmp_path, "nbr", lambda c: c.update(norm_before_residual=True))
    dc = read_draft_config(nbr)
    assert SG.draft_norms(dc)["norm_before_residual"] is False and VL.draft_norms(dc)["norm_before_residual"] is True
    assert DraftArch.from_config(nbr, VL).norm_before_residual and not DraftArch.from_config(nbr).norm_before_residual
    s = seqs[0]
    T = int(s.tokens.shape[0])
    a, b = (Eagle3Draft.load(nbr, REFERENCE_TARGET, loader=x).extend(s.tokens[1:T], s.aux[: T - 1]).logits
            for x in (SG, VL))
    assert (a - b).abs().max() > 1e-3
    # the legacy use_aux_norm: SGLang builds fc_norm, vLLM refuses the checkpoint's per-chunk norms
    aux = read_draft_config(_variant(tmp_path, "aux", lambda c: c.update(use_aux_norm=True)))
    assert SG.draft_norms(aux)["fc_norm"] is True
    with pytest.raises(BadInput, match=r"\[use_aux_norm\].*reads fc_norm only"):
        VL.draft_norms(aux)
    # lm_head: draft_vocab_size absent with a full-vocab lm_head and no d2t: SGLang takes the target's head
    # (load_lm_head_from_target), vLLM keeps the checkpoint's
    def full_head(w):
        w["lm_head.weight"] = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0)).to(
            w["lm_head.weight"].dtype)
        del w["d2t"], w["t2d"]
    full = _variant(tmp_path, "full", lambda c: c.pop("draft_vocab_size"), full_head)
    dfull = read_draft_config(full)
    names = list(load_file(str(full / "model.safetensors")))
    assert SG.draft_tensors(dfull, names)["lm_head"] == "target"
    assert VL.draft_tensors(dfull, names)["lm_head"] == "draft"
    sg_head = Eagle3Draft.load(full, REFERENCE_TARGET, loader=SG).lm_head
    vl_head = Eagle3Draft.load(full, REFERENCE_TARGET, loader=VL).lm_head
    assert torch.equal(vl_head, load_file(str(full / "model.safetensors"))["lm_head.weight"].float())
    # the reference target ties its lm_head to its embedding: SGLang's draft takes that
    assert torch.equal(sg_head, load_file(str(REFERENCE_TARGET / "model.safetensors"))["model.embed_tokens.weight"]
                       .float()) and not torch.equal(sg_head, vl_head)
    # d2t: with draft_vocab_size equal to the vocab SGLang still applies a checkpoint d2t; vLLM refuses it at load
    def zero_map(w):
        full_head(w)
        w["d2t"] = torch.zeros(4096, dtype=torch.int64)
    keep = _variant(tmp_path, "keep", lambda c: c.pop("draft_vocab_size"), zero_map)
    dk = read_draft_config(keep)
    kn = list(load_file(str(keep / "model.safetensors")))
    assert SG.draft_tensors(dk, kn)["d2t"] == "checkpoint"
    with pytest.raises(BadInput, match=r"\[d2t\].*draft_id_to_target_id"):
        VL.draft_tensors(dk, kn)
    # no lm_head and a reduced draft vocab: vLLM gives the target's full head, the d2t scatter fails
    nohead = _variant(tmp_path, "nohead", lambda c: None, lambda w: w.pop("lm_head.weight"))
    dn = read_draft_config(nohead)
    with pytest.raises(BadInput, match=r"\[lm_head.weight\].*compute_logits"):
        VL.draft_tensors(dn, list(load_file(str(nohead / "model.safetensors"))))
