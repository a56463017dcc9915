"""The NextN investigate page's texts a fresh user found wrong on a clean run (no server): the draft gain's log figure,
the reference named as the source, and what the verdict's seconds measure."""
from __future__ import annotations

from helpers.draft.budget import gains
from helpers.investigation.story import (VERDICT_DEFAULT, headline_parts, named_text, naming_seconds, provenance,
                                         reference_source, verdict_words)
from helpers.records import Finding, InvestigationDoc

OWN = "the server's own every-layer capture (sglang /generate return_hidden_states, every layer)"


def _nextn_budget(log_al: float, al: float) -> dict:
    """A NextN budget as helpers/investigation/mtp.py::mtp_budget writes it: no "training log" stage, the log's
    accept length on the checkpoint stage (helpers/draft/draft_stage.py), the draft loss = log - checkpoint."""
    d = log_al - al
    table = [{"step": 0, "acc": al - 1.0, "log_acc": log_al - 1.0}]
    ck = {"name": "checkpoint (teacher-forced)", "accept_length": al, "ci": [al - 0.02, al + 0.03], "table": table,
          "log_accept_length": log_al, "log_kind": {"split": "validation"},
          "rows": {"sequences": 8, "path": "rows.jsonl", "kind": {"split": "validation", "text": "chat"}}}
    basis = f"training log {log_al:.2f} vs the checkpoint {al:.2f} on comparable rows"
    return {"stages": [ck], "losses": {"draft": {"stage": "draft", "delta": d, "ci": [d - 0.02, d + 0.03],
                                                 "basis": basis, "decision": "clear"}}}


def test_the_draft_gain_quotes_the_log_figure_of_its_own_basis():
    """(a) The gain said "above its training log's n/a" while the basis column said 1.48: a NextN budget has no
    "training log" stage; the log's accept length is the checkpoint stage's own."""
    b = _nextn_budget(1.48, 1.49)
    (g,) = gains(b)
    log_in_basis = b["losses"]["draft"]["basis"].split()[2]
    assert log_in_basis == "1.48" and f"above its training log's {log_in_basis}" in g["text"]
    assert "n/a" not in g["text"] and "the checkpoint scores 1.49" in g["text"] and g["stage"] == "draft"
    # an EAGLE-3 budget with a "training log" stage and the same figure on the checkpoint stage reads the same
    b["stages"].insert(0, {"name": "training log", "accept_length": 1.48, "ci": [None, None]})
    assert "above its training log's 1.48" in gains(b)[0]["text"]


def test_a_nextn_source_names_the_every_layer_reference_not_training_data():
    """(b) A NextN run compares the served hidden state with the target's every-layer reference (the server's own
    capture, else HF): the source line said "served tensors vs training data"."""
    doc = InvestigationDoc(verdict="ok", diagnosis={"kind": "mtp"}, reference={"how": OWN, "path": "d"})
    src = headline_parts(doc)[0]["source"]
    assert src == f"served hidden state vs the target's every-layer reference ({OWN})"
    assert "training data" not in src
    f = Finding(kind="norm_mismatch", chunk=0, detail="x", evidence={"rel_error": {"out(n-1)": 0.3}})
    assert provenance(f, doc) == src and provenance(f) == "served tensors vs training data"
    steps = Finding(kind="mtp_steps_beyond_head", chunk=None, detail="x",
                    evidence={"source": "the log's hyper.train_steps", "stage": "settings"})
    assert provenance(steps, doc) == "the log's hyper.train_steps"
    hf = InvestigationDoc(verdict="ok", diagnosis={"kind": "eagle1"}, reference={"how": "HF transformers on /t"})
    assert reference_source(hf).endswith("(HF transformers on /t)")
    assert reference_source(InvestigationDoc(diagnosis={"kind": "mtp"}, reference={"how": "none"})).endswith(
        "(none recorded)")
    eagle3 = InvestigationDoc(verdict="ok", diagnosis={"kind": "eagle3"}, reference={"how": OWN})
    assert reference_source(eagle3) is None and headline_parts(eagle3)[0]["source"] == "served tensors vs training data"


def test_the_verdict_seconds_say_what_they_waited_for():
    """(c) The NextN path sets seconds_to_verdict after the acceptance budget and the engine-state probes: the page
    called it "the diagnosis's verdict" (56.6 s, the whole clean run); it now says what it waited for."""
    doc = InvestigationDoc(verdict="ok", diagnosis={"kind": "mtp"}, wall_s=56.9, seconds_to_verdict=56.6,
                           timings={"capture": 8.0, "acceptance budget": 20.0, "engine state": 25.0})
    secs, out = naming_seconds(doc)
    text = named_text(secs, doc.seconds_to_verdict, left_out=out, verdict=verdict_words(doc))
    assert secs == 31.9 and "the 25.0 s of the steps after it" in text
    assert ("; the verdict (set once the acceptance budget and the engine-state probes are in) came 56.6 s after "
            "attach)") in text and "diagnosis's verdict" not in text
    assert verdict_words(InvestigationDoc(diagnosis={"kind": "eagle3"})) == VERDICT_DEFAULT
    assert named_text(None, 3.2, verdict=VERDICT_DEFAULT) == f"({VERDICT_DEFAULT} came 3.2 s after attach)"
