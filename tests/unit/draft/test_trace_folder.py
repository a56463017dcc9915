"""The draft step trace folder as the breaker left it (breaker report items 1-4): an ARMED file that is not ours, two
checks at once, damaged trace files, a folder reused by a new server. No server: the hook on fake SGLang calls (as
tests/unit/draft/test_trace.py) and the SGLang adapter's ``trace_requests`` on a fake client."""
from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from helpers.draft.trace import read_trace, trace_counts
from helpers.engines.sglang import SGLangAdapter
from helpers.errors import BadInput
from helpers.hooks import ARM_FILE
from helpers.runfiles import armed_file
from helpers.trace_hooks import draft_trace_factory, next_trace_number, trace_hook_specs

MOD = SimpleNamespace(config=SimpleNamespace(architectures=["LlamaForCausalLMEagle3"]))


def _extend(hook, ids, rids):
    """One EXTEND forward of ``len(rids)`` requests of 2 tokens each through the hook; logits row r = arange + r."""
    bs = len(rids)
    fb = SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), positions=torch.tensor([0, 1] * bs),
                         batch_size=bs, seq_lens=torch.tensor([2] * bs), req_pool_indices=torch.arange(bs),
                         extend_seq_lens=torch.tensor([2] * bs), rids=list(rids))
    logits = torch.stack([torch.arange(6, dtype=torch.float32).roll(r) for r in range(bs)])
    hook(MOD, (torch.tensor(ids), None, None, fb), SimpleNamespace(next_token_logits=logits))


@pytest.fixture
def trace(tmp_path):
    """A trace folder armed by hand holding two forwards of rank 0 (rids a, b)."""
    out = tmp_path / "trace"
    out.mkdir()
    (out / ARM_FILE).write_text("")
    hook = draft_trace_factory({"out_dir": str(out), "topk": 2})
    _extend(hook, [5, 6], ["a"])
    _extend(hook, [7, 8], ["b"])
    (out / ARM_FILE).unlink()
    return out


class _Client:
    """A fake SGLang client whose /server_info runs the trace hook into ``out``; ``generate`` calls ``during``."""

    def __init__(self, out, during=None):
        self.info = {"forward_hooks": trace_hook_specs(out)}
        self.during = during

    def server_info(self):
        return self.info

    def flush_cache(self):
        pass

    def generate(self, **kw):
        self.during()
        raise RuntimeError("stop after the check made while armed")


class _Prompt:
    input_ids = [1, 2, 3]

    def request(self):
        return {"input_ids": list(self.input_ids)}


# --------------------------------------------------------------------------- 1 + 4: the arm file
@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_an_armed_file_not_ours_is_refused_never_written_through_nor_deleted(tmp_path, trace, planted):
    precious = tmp_path / "precious.txt"
    precious.write_text("precious user data\n")
    arm = trace / ARM_FILE
    if planted == "symlink":
        arm.symlink_to(precious)
    else:
        arm.write_text("precious user data\n")
    with pytest.raises(BadInput) as e:
        SGLangAdapter().trace_requests(_Client(trace), [_Prompt()], max_new_tokens=4, tag="t", folder=tmp_path)
    msg = str(e.value)
    assert str(arm) in msg and ("a symlink" if planted == "symlink" else "a file") in msg and "\n" not in msg
    assert precious.read_text() == "precious user data\n"                  # never written through
    assert os.path.lexists(arm) and (arm.is_symlink() if planted == "symlink" else
                                     arm.read_text() == "precious user data\n")  # never deleted


def test_two_traces_on_one_server_the_second_is_refused_and_the_first_keeps_its_arm(tmp_path, trace):
    seen = {}

    def second_check():
        seen["armed_during"] = (trace / ARM_FILE).read_text()
        with pytest.raises(BadInput, match="another trace or capture is armed") as e:
            SGLangAdapter().trace_requests(_Client(trace), [_Prompt()], max_new_tokens=4, tag="B", folder=tmp_path)
        seen["b"] = str(e.value)
        seen["after_b"] = (trace / ARM_FILE).exists()         # B did not unlink A's arm

    with pytest.raises(RuntimeError, match="stop after"):
        SGLangAdapter().trace_requests(_Client(trace, second_check), [_Prompt()], max_new_tokens=4, tag="A",
                                       folder=tmp_path)
    assert "(A, pid" in seen["armed_during"] and seen["after_b"] is True
    assert not os.path.lexists(trace / ARM_FILE)                   # A removed its own arm at the end


def test_an_arm_replaced_meanwhile_is_not_deleted(tmp_path):
    arm = tmp_path / ARM_FILE
    with armed_file(arm, "mine\n"):
        arm.unlink()
        arm.write_text("the user's\n")                              # another inode under the same name
    assert arm.read_text() == "the user's\n"
    with armed_file(arm.with_name("OTHER"), "mine\n") as p:
        assert p.read_text() == "mine\n"
    assert not p.exists()


# --------------------------------------------------------------------------- 2: a damaged trace folder
def test_a_fifo_index_is_refused_not_waited_on(trace):
    (trace / "rank1").mkdir()
    os.mkfifo(trace / "rank1" / "index.jsonl")
    old = signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("trace_counts hung")))
    signal.alarm(10)
    try:
        with pytest.raises(BadInput, match="FIFO") as e:
            trace_counts(trace)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert "rank1/index.jsonl" in str(e.value)


def test_folders_not_named_rank_digits_are_left_alone(trace):
    (trace / "rank_old").mkdir()
    (trace / "rank_old" / "index.jsonl").write_text("garbage\n")
    (trace / "rankings").write_text("a file\n")
    assert trace_counts(trace) == {0: 2}


def test_a_torn_last_line_is_skipped_and_a_torn_middle_line_is_named(trace):
    rids = trace / "rank0" / "rids.jsonl"
    idx = trace / "rank0" / "index.jsonl"
    whole = rids.read_text()
    rids.write_text(whole + '{"forward": 2, "ri')                   # the hook writing its next line now
    with open(idx, "a") as fh:
        fh.write('{"forward": 2, "fi')
    assert trace_counts(trace) == {0: 2}
    recs = read_trace(trace)
    assert [r["rids"] for r in recs] == [["a"], ["b"]] and recs[1]["topk"].tolist() == [[5, 4]]
    # the torn line completed by the next write: the damage sits in the middle now, named with its line
    rids.write_text(whole.splitlines()[0] + "\n" + '{"forward": 1, "ri{"forward": 1, "rids": ["b"]}\n')
    with pytest.raises(BadInput) as e:
        read_trace(trace)
    assert "rids.jsonl" in str(e.value) and "line 2 is not a trace record" in str(e.value)
    # a later check reads only what comes after it: the old damage never fails it again
    assert read_trace(trace, since={0: 2}) == []


def test_an_index_line_naming_a_file_outside_its_rank_folder_is_refused(tmp_path, trace):
    idx = trace / "rank0" / "index.jsonl"
    lines = idx.read_text().splitlines()
    outside = tmp_path / "elsewhere.safetensors"
    (trace / "rank0" / "trace000001.safetensors").rename(outside)
    for name, says in (("../../elsewhere.safetensors", "not a file name inside its rank folder"),
                       (str(outside), "not a file name inside its rank folder"),
                       ("trace000001.safetensors", "leads out of its rank folder")):
        if says.startswith("leads"):
            (trace / "rank0" / name).symlink_to(outside)
        rec = json.loads(lines[1]) | {"file": name}
        idx.write_text(lines[0] + "\n" + json.dumps(rec) + "\n")
        with pytest.raises(BadInput, match=says) as e:
            read_trace(trace)
        assert "index.jsonl" in str(e.value) and "line 2" in str(e.value)


# --------------------------------------------------------------------------- 3: a folder holding a trace
def test_a_new_server_on_a_folder_with_a_trace_numbers_on_and_overwrites_nothing(trace):
    r0 = trace / "rank0"
    before = {f.name: f.read_bytes() for f in r0.glob("trace*.safetensors")}
    assert next_trace_number(str(r0)) == 2 and next_trace_number(str(trace / "rank9")) == 0
    since = trace_counts(trace)
    (trace / ARM_FILE).write_text("")
    hook = draft_trace_factory({"out_dir": str(trace), "topk": 2})            # the next server's hook: n from 0
    _extend(hook, [9, 10], ["c"])
    (trace / ARM_FILE).unlink()
    assert {f.name: f.read_bytes() for f in r0.glob("trace*.safetensors") if f.name in before} == before
    assert sorted(f.name for f in r0.glob("trace*.safetensors")) == [f"trace00000{i}.safetensors" for i in range(3)]
    (new,) = read_trace(trace, since=since)
    assert new["forward"] == 2 and new["rids"] == ["c"] and new["input_ids"].tolist() == [10]
    assert [r["rids"] for r in read_trace(trace)] == [["a"], ["b"], ["c"]]      # the old lines still read the old


# --------------------------------------------------------------------------- tensors the hook never writes (B8)
#: a trace file's tensors changed: (tensor named in the error, its new value or None to drop it, what the error says)
DAMAGED = [
    ("row_req", None, "missing"),
    ("topk", torch.zeros(1, 0, dtype=torch.int64), r"no top-k column \(expected \[N, k >= 1\]\)"),
    ("topk_draft", torch.zeros(1, 0, dtype=torch.int64), "no top-k column"),
    ("positions", torch.tensor([[1]]), r"expected an integer tensor \[N\], got \[1, 1\]"),
    ("topk", torch.tensor(5), r"expected an integer tensor \[N, k\], got \[\]"),
    ("input_ids", torch.tensor([6, 6]), "2 rows, row_req has 1"),
    ("positions", torch.tensor([1.0]), r"got \[1\] torch.float32"),
    ("row_req", torch.tensor([-1]), r"request index -1 is outside 0 .. 0 \(the forward's 1 request ids\)"),
    ("row_req", torch.tensor([1]), r"request index 1 is outside 0 .. 0"),
]


@pytest.mark.parametrize("name,value,says", DAMAGED, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(DAMAGED)])
def test_a_trace_file_with_missing_or_misshapen_tensors_is_refused_naming_file_and_tensor(trace, name, value, says):
    """The hook's own trace reads back (row_req / positions / input_ids [N], topk / topk_draft [N, k]); the same file
    with one tensor dropped, misshapen or out of range is one BadInput naming the file and the tensor, never a
    KeyError / IndexError / TypeError later in request_cycles, nor a row_req of -1 read as the last rid."""
    from safetensors.torch import load_file, save_file
    recs = read_trace(trace)
    assert [r["row_req"].tolist() for r in recs] == [[0], [0]] and recs[0]["topk"].shape == (1, 2)
    f = trace / "rank0" / "trace000001.safetensors"
    t = load_file(str(f))
    if value is None:
        t.pop(name)
    else:
        t[name] = value
    save_file(t, str(f))
    with pytest.raises(BadInput, match=says) as e:
        read_trace(trace)
    msg = str(e.value)
    assert msg.startswith(f"{f} [{name}]: forward 1: ") and "\n" not in msg
