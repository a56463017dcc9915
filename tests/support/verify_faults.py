"""A test-only fault of verification at temperature > 0: an SGLang ``--forward-hooks`` factory that, loaded in the
server process, wraps the function SGLang's EAGLE verify calls to accept drafts, so that at temperature > 0 a draft
token is accepted only when it also equals an *independent* sample of the target (a coin not coupled to the token
emitted). Greedy batches (temperature 0) are untouched, so the acceptance budget's greedy measurement cannot see it;
the engine-state probe ``sampled_verify`` must. A fixture: nothing in ``helpers/`` names it, no flag of the tool
reaches it; it acts only while its ``arm`` file exists (off by default), or for the server's whole life when ``arm``
is None (the generated ``sampled_verify`` class of ``tests/support/engine_faults.py``). An arm file whose text is a
number in [0, 1] sets the share of rows while it exists (a strength sweep on one server:
``bench/bench_sampled_verify.py --strengths``).

What it patches, in SGLang 0.5.23 (read in the installed package):

* ``sglang/srt/speculative/eagle_worker_common.py`` calls ``eagle_sample(verify_input, batch, logits_output, ...)``
  by the name it imported from ``sglang/srt/speculative/eagle_utils.py``; the factory replaces that module attribute
  (once per process) with a wrapper. ``eagle_sample`` returns ``(predict, accept_lens, accept_index)``: ``predict``
  flat ``[bs * draft_token_num]`` (int32; at an accepted node the next accepted token, at the last one the bonus),
  ``accept_lens`` ``[bs]`` = accepted drafts + 1, ``accept_index`` ``[bs, max_tree_depth]`` the flat node index per
  depth (-1 after the last accepted).
* the wrapper runs the original, then, for a batch with ``batch.sampling_info.is_all_greedy`` false, on a share
  ``strength`` of its rows (a seeded generator): walks the accepted depths, draws an independent token from the
  target's ``softmax(next_token_logits[parent] / temperature)`` at each, and cuts the row where the draw is not the
  accepted draft (``accept_lens`` and ``accept_index`` shortened). The kept last node's ``predict`` is the draft that
  was accepted after it, so the emitted tokens are the same: only the accept counts fall (``spec_verify_ct`` rises;
  ``sglang/srt/managers/scheduler_components/batch_result_processor.py`` reads ``result.accept_lens``).
* every TP rank runs the same verify: the cut is broadcast from rank 0 (``sglang/srt/runtime_context.py::
  get_parallel``'s ``tp_group.broadcast``, as ``eagle_sample`` does on its sampling path) so ranks commit the same
  lengths.

On CPU SGLang verifies with the argmax at every temperature (``eagle_utils.py::_verify_uses_greedy``); the wrapper
is the same on either path (it acts on ``eagle_sample``'s result, not inside a kernel).

Importable in SGLang's venv: torch only (SGLang itself lazily, inside the factory).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

FACTORY = "tests.support.verify_faults:factory"
_STATE: dict = {"patched": False, "cut_rows": 0, "rows": 0}


def spec(arm: Optional[str], *, strength: float = 1.0, seed: int = 0) -> dict:
    """The ``--forward-hooks`` spec of the fault: acts while the file ``arm`` exists (None: always), on a share
    ``strength`` of the sampled rows of each verify step, with a generator seeded ``seed``."""
    return {"name": "e3f-test-sampled-verify-coin", "target_modules": ["logits_processor"], "hook_factory": FACTORY,
            "config": {"arm": None if arm is None else str(arm), "strength": float(strength), "seed": int(seed)}}


def armed_strength(arm: Optional[str], strength: float) -> Optional[float]:
    """The share of sampled rows the fault acts on now: None while the file ``arm`` is absent (off); ``strength`` when
    ``arm`` is None (always on) or the file holds no number; the file's number when it holds one in [0, 1].

    Raises: ValueError for a number outside [0, 1] in the arm file (naming the file)."""
    if arm is None:
        return strength
    try:
        text = open(arm).read().strip()
    except FileNotFoundError:
        return None
    try:
        x = float(text)
    except ValueError:
        return strength
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"{arm}: expected a share of rows in [0, 1] or no number, got {text!r}")
    return x


def cut_rows(predict: torch.Tensor, accept_lens: torch.Tensor, accept_index: torch.Tensor, logits: torch.Tensor,
             temperatures: torch.Tensor, pick: torch.Tensor, gen: torch.Generator) -> int:
    """Cut the rows ``pick`` (bool ``[bs]``) of a verify result in place where an independent draw of the target at
    an accepted depth is not the accepted draft; returns how many rows were cut. ``logits`` ``[bs * N, V]`` float,
    ``temperatures`` ``[bs, 1]`` or ``[bs]``."""
    cut = 0
    temps = temperatures.reshape(-1).float()
    for b in torch.nonzero(pick).flatten().tolist():
        n = int(accept_lens[b]) - 1                       # accepted drafts
        for j in range(1, n + 1):
            parent = int(accept_index[b, j - 1])
            probs = torch.softmax(logits[parent].float() / temps[b].clamp_min(1e-5), dim=-1)
            x = int(torch.multinomial(probs, 1, generator=gen))
            if x != int(predict[parent]):                 # the draft accepted at depth j is predict[parent]
                accept_index[b, j:] = -1
                accept_lens[b] = j
                cut += 1
                break
    return cut


def factory(config: dict) -> Any:
    arm = config.get("arm")
    strength = float(config.get("strength", 1.0))
    gen = torch.Generator().manual_seed(int(config.get("seed", 0)))
    if not _STATE["patched"]:
        import sglang.srt.speculative.eagle_worker_common as common  # lazy: only inside SGLang
        from sglang.srt.runtime_context import get_parallel

        original = common.eagle_sample

        def eagle_sample(verify_input, batch, logits_output, *args, **kwargs):
            predict, accept_lens, accept_index = original(verify_input, batch, logits_output, *args, **kwargs)
            info = batch.sampling_info
            share = armed_strength(arm, strength)
            if share is None or info is None or info.is_all_greedy:
                return predict, accept_lens, accept_index
            with torch.no_grad():
                bs = int(accept_lens.shape[0])
                pick = torch.rand(bs, generator=gen) < share
                _STATE["rows"] += bs
                _STATE["cut_rows"] += cut_rows(predict, accept_lens, accept_index,
                                               logits_output.next_token_logits, info.temperatures, pick, gen)
                group = get_parallel().tp_group
                if group.world_size > 1:
                    group.broadcast(accept_lens, src=0)
                    group.broadcast(accept_index, src=0)
            return predict, accept_lens, accept_index

        common.eagle_sample = eagle_sample
        _STATE["patched"] = True

    def hook(module, inputs, output):
        return None

    return hook
