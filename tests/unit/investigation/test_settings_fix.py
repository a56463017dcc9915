"""The settings stage's recommendation as the proposed fix (helpers.investigation.live._settings_fix): it replaces a fix
that only requests speculative flags (the no-op draft-token request of num_draft_tokens_overridden, seen on a steps-2
server launched with 4 draft tokens), never a fix that changes the draft or the wiring."""
from __future__ import annotations

from helpers.investigation.live import _settings_fix
from helpers.records import ProposedFix

BUDGET = {"cause": "settings", "recommended_settings": {"steps": 3, "topk": 1, "draft_tokens": 4},
          "losses": {"settings": {"basis": "--speculative-num-steps 3 (chain) accepts +0.38 tokens per verify step"}}}
FLAGS = {"--speculative-num-steps": 3, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": 4}


def test_no_fix_becomes_the_recommended_settings():
    fix = ProposedFix()
    _settings_fix(fix, BUDGET)
    assert fix.server_args == FLAGS and fix.applicable and fix.addresses == ["spec_settings_low"]


def test_a_speculative_flag_request_is_superseded():
    fix = ProposedFix(kind="config", applicable=True, server_args={"--speculative-num-draft-tokens": 3},
                      parts=["request --speculative-num-draft-tokens 3 (what SGLang runs with topk 1 anyway)"],
                      addresses=["num_draft_tokens_overridden"])
    _settings_fix(fix, BUDGET)
    assert fix.server_args == FLAGS
    assert fix.addresses == ["num_draft_tokens_overridden", "spec_settings_low"]
    assert fix.parts == ["launch with --speculative-num-steps 3 --speculative-eagle-topk 1 "
                         "--speculative-num-draft-tokens 4"]


def test_a_wiring_fix_is_kept():
    fix = ProposedFix(kind="config", applicable=True,
                      draft_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
                      server_args={"--speculative-num-draft-tokens": 3}, addresses=["layer_offset"])
    _settings_fix(fix, BUDGET)
    assert fix.server_args == {"--speculative-num-draft-tokens": 3} and fix.addresses == ["layer_offset"]


def test_another_cause_leaves_the_fix():
    fix = ProposedFix()
    _settings_fix(fix, {**BUDGET, "cause": "none"})
    assert fix.kind == "none" and not fix.server_args
