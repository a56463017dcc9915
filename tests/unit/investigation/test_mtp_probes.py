"""The engine-state probes on an MTP / NextN head's server: each probe's own declaration of how it applies
(``Probe.mtp``: as is, with the head offline, or not, with the SGLang code that says why), the runner honouring it,
and the probes' results joined into the NextN budget's engine stage (``helpers.investigation.mtp.mtp_budget`` with
the head run offline on real states)."""
from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from helpers.draft.budget import _loss
from helpers.draft.loader import load_draft
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences
from helpers.investigation.mtp import CHECKPOINT_STAGE, budget_sentence, mtp_budget
from helpers.investigation.probes import MTP_USES, join_engine_state, probes, run_probes
from support import ROOT
from test_probes import FakeEngine, _ctx

SGLANG = ROOT / "env" / "reference" / ".venv" / "lib" / "python3.11" / "site-packages"
TARGET = ROOT / "env" / "models" / "kimi" / "target"
HEAD = {"class": "DeepseekV3ForCausalLMNextN", "family": "deepseek_v3", "layers": 1}


def test_every_probe_says_how_it_stands_on_an_mtp_head_citing_code_that_exists():
    """Every probe declares its use on a NextN head; the three that run the draft offline take the offline head,
    the oracle does not apply; every ``sglang/...py::Name`` it cites is a file of the installed SGLang holding
    ``Name`` (so a citation that drifts from the package fails here)."""
    got = {p.name: p.mtp for p in probes()}
    assert set(got.values()) <= set(MTP_USES)
    assert {n for n, u in got.items() if u == "offline head"} == {"served_draft", "step_trace", "sampled_verify"}
    assert {n for n, u in got.items() if u == "no"} == {"oracle"}
    if not (SGLANG / "sglang").is_dir():
        pytest.skip("SGLang's venv is not installed here")
    cited = 0
    for p in probes():
        assert p.mtp_why, p.name
        for path, name in re.findall(r"(sglang/[\w/]+\.py)::([\w.]+)", p.mtp_why):
            src = (SGLANG / path).read_text()
            assert re.search(rf"\b(def|class) {re.escape(name.split('.')[-1])}\b", src), (p.name, path, name)
            cited += 1
    assert cited >= 10


def _mtp(ctx):
    ctx.att = SimpleNamespace(restart={"kind": "embedded"}, draft_head=HEAD, spec={"num_steps": 1, "topk": 1})
    ctx.adapter.oracle_flags = lambda: {"--speculative-algorithm": "STANDALONE"}
    return ctx


def test_the_runner_skips_what_does_not_apply_to_a_head_and_records_how_the_rest_ran(tmp_path):
    """On a head's server the oracle is skipped with its reason (before any copy is started), the radix probe runs
    as is and says so in its evidence; on an EAGLE-3 server the same oracle is not refused for that reason."""
    eng = FakeEngine(lambda i, hit: 1 + i % 3)
    st = run_probes(_mtp(_ctx(tmp_path / "mtp", eng, n=6)), "all", only=["oracle", "radix_hit"])
    r = {p["probe"]: p for p in st["probes"]}
    assert r["oracle"]["status"] == "skipped"
    assert r["oracle"]["why"].startswith("does not apply to an MTP / NextN head") and \
        "DeepseekV3ForCausalLMNextN" in r["oracle"]["why"]
    assert r["radix_hit"]["status"] == "ran" and r["radix_hit"]["decision"] == "clear"
    assert r["radix_hit"]["evidence"]["mtp"]["use"] == "as is" and "deepseek_nextn" in \
        r["radix_hit"]["evidence"]["mtp"]["why"]
    ctx = _ctx(tmp_path / "eagle3", eng, n=6, restart={"kind": "embedded"})
    ctx.att.draft_head = None
    st3 = run_probes(ctx, "all", only=["oracle", "radix_hit"])
    r3 = {p["probe"]: p for p in st3["probes"]}
    assert "MTP" not in (r3["oracle"]["why"] or "") and "mtp" not in r3["radix_hit"]["evidence"]


@pytest.mark.parametrize("which", ["cheap", "none"])
def test_on_a_head_the_oracle_is_never_said_to_run_with_all(tmp_path, which):
    """With the default cheap probes (or none) a head's oracle was skipped as "not asked for (... --engine-probes all
    runs it ...)", though no value runs it on a head: the skip says it does not apply, and why."""
    eng = FakeEngine(lambda i, hit: 1 + i % 3)
    st = run_probes(_mtp(_ctx(tmp_path, eng, n=6)), which, only=["oracle"])
    why = {p["probe"]: p for p in st["probes"]}["oracle"]["why"]
    assert why.startswith("does not apply to an MTP / NextN head") and "engine-probes all" not in why


@pytest.fixture(scope="module")
def head_budget():
    """The NextN budget of the shipped head run offline (the loader's seam) on 6 real sequences of the validation
    rows' tokens with random post-norm-scale states, the live counters equal to the offline run (a clean engine),
    and a draft stage cleared on the log's rows."""
    if not (TARGET / "model.safetensors").is_file():
        pytest.skip("env/models/kimi/target is not built here")
    head = load_draft(TARGET, TARGET)
    g = torch.Generator().manual_seed(0)
    seqs = [SimSequence(f"p{i}", torch.randint(0, 1000, (40,), generator=g),
                        torch.randn(40, head.arch.hidden, generator=g) * 1.8, 8) for i in range(6)]
    st = DraftSettings(1, 1, 2)
    live = simulate_sequences(head, seqs, [st], max_new_tokens=32)["per_request"][st]
    al = float(live["completion_tokens"].sum() / live["verify_ct"].sum())
    draft = {"stage": {"name": CHECKPOINT_STAGE, "accept_length": al, "ci": [al - 0.02, al + 0.02]},
             "loss": _loss("draft", -0.01, -0.03, 0.02, "log - checkpoint", al, n=48, unit="rows")}
    b = mtp_budget(head, seqs, seqs, pd.DataFrame(live), st, max_new_tokens=32, draft=draft)
    return lambda: copy.deepcopy(b)


def _state(decision, delta, lo, hi, ref):
    loss = _loss("radix_hit", delta, lo, hi, "cold vs hit", ref, n=6, unit="prompts")
    return {"probes": [{"probe": "radix_hit", "cost": "cheap", "condition": "with the prompt's prefix in the radix "
                        "cache", "status": "ran", "decision": decision, "loss": loss, "findings": [], "evidence": {},
                        "part": "cache state"}], "findings": []}


def test_probes_join_the_heads_engine_stage(head_budget):
    """A clean head budget (every stage clear: cause none); a clear probe keeps it; an undecided one opens the engine
    stage (cause undecided, never none); a counted one is the engine loss measured on the server (cause engine). The
    NextN sentence names the engine's parts."""
    b = head_budget()
    assert b["cause"] == "none" and b["losses"]["engine"]["delta"] == 0, b["sentence"]
    assert b["required"] == ("draft", "wiring", "engine")
    ref = b["stages"][-1]["accept_length"]
    clear = join_engine_state(head_budget(), _state("clear", 0.0, 0.0, 0.0, ref))
    assert clear["cause"] == "none" and clear["losses"]["engine"]["decision"] == "clear"
    assert "cache state clear" in budget_sentence(clear)
    open_ = join_engine_state(head_budget(), _state("undecided", 0.05, -0.1, 0.3, ref))
    assert open_["cause"] == "undecided" and open_["losses"]["engine"]["probe"] == "radix_hit"
    lost = join_engine_state(head_budget(), _state("counts", 0.4, 0.3, 0.5, ref))
    assert lost["cause"] == "engine" and lost["losses"]["engine"]["on_server"]
    assert lost["losses"]["engine"]["cold"]["decision"] == "clear"
    s = budget_sentence(lost)
    assert s.startswith("NextN accept length") and "Cause: engine" in s and "cache state counts" in s, s


def test_probes_take_the_budgets_head_at_their_dtype_and_load_their_own_otherwise():
    """``checkpoint_draft`` takes the head a stage already loaded (``ctx.extra[LOADED_DRAFT]``) when its dtype is the
    one the probes choose for the server (float32 here): the same object, not loaded again; a head of another dtype
    is not taken: the checkpoint is loaded at the chosen dtype, and it drafts as the given head does on real
    states (the same accept length offline)."""
    from helpers.investigation.probes.trace import LOADED_DRAFT, checkpoint_draft
    if not (TARGET / "model.safetensors").is_file():
        pytest.skip("env/models/kimi/target is not built here")
    head = load_draft(TARGET, TARGET)

    def ctx(dtype):
        return SimpleNamespace(extra={LOADED_DRAFT: (head, dtype)},
                               att=SimpleNamespace(draft_dir=TARGET, target_dir=TARGET, version="0.5.23"),
                               client=SimpleNamespace(server_info=lambda: {"dtype": "float32"}),
                               adapter=SimpleNamespace(loader_rules=lambda v: None))
    assert checkpoint_draft(ctx(torch.float32)) is head
    own = checkpoint_draft(ctx(torch.bfloat16))
    assert own is not head and own.dtype == torch.float32
    g = torch.Generator().manual_seed(1)
    seqs = [SimSequence(f"p{i}", torch.randint(0, 1000, (24,), generator=g),
                        torch.randn(24, head.arch.hidden, generator=g) * 1.8, 6) for i in range(3)]
    st = DraftSettings(1, 1, 2)
    a, b = (simulate_sequences(h, seqs, [st], max_new_tokens=16)["per_request"][st] for h in (head, own))
    assert a["verify_ct"].tolist() == b["verify_ct"].tolist() and a["verify_ct"].sum() > 0
