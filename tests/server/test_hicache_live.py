"""The host-tier probe ``hicache_hit`` on the embedded CPU SGLang server (extended: make test-all): what holds here.

SGLang 0.5.23's hierarchical cache cannot start on CPU, so the probe is skipped on this server; this module checks the
two premises of that and of the probe's mechanism against the real server:

* a copy started with the flags the adapter gives a GPU server fails at start inside the host pool's allocation
  (``sglang/srt/mem_cache/pool_host/base.py::HostKVCache._allocate_host_buffer``: its host-memory budget, then the
  CUDA pinning of ``pool_host/common.py::alloc_with_host_register``), and the probe's ``applies`` says so;
* the probe's request sequence (:func:`helpers.investigation.probes.hicache.evict_and_resend`) on a server with the
  device pool the probe would give (``--max-total-tokens``) really evicts the prompts' KV: resent after the fillers,
  no prompt is served from the cache beyond a few tokens it shares with another prompt, where the same prompts resent
  without fillers are served whole but the last tokens; the answers say 0 tokens from host (the proof the probe
  needs is read from the real answers), and the accept length is the cold one (greedy, the same verify steps).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.sglang import SGLangAdapter
from helpers.errors import ServerStartError
from helpers.investigation.probes import ProbeContext
from helpers.investigation.probes.cache import cold_arm, warm_arm
from helpers.investigation.probes.hicache import HICACHE_HIT, evict_and_resend, fillers, sizes
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET
from support import ROOT

pytestmark = [pytest.mark.server, pytest.mark.extended]


def _restart() -> dict:
    return {"kind": "embedded", "launch": {"engine": "sglang", "target": str(REFERENCE_TARGET),
                                           "draft": str(REFERENCE_DRAFT), "tp": 1, "spec": None,
                                           "forward_hooks": None, "extra_args": [], "dtype": "float32", "env": {}}}


@pytest.fixture(autouse=True)
def _env():
    if not (ROOT / "env" / "reference" / ".venv" / "bin" / "python").exists():
        pytest.skip("the SGLang reference environment is not installed (env/reference/install.sh)")


def test_the_host_tier_cannot_start_on_cpu_and_the_probe_says_so(tmp_path):
    ad = SGLangAdapter()
    launch, why = ad.host_cache_launch({"device": "cuda"}, device_tokens=1024, host_tokens=4096)
    assert why is None
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError):
        h = ad.start_variant(_restart(), log_path=log, budget=Budget(600), flags=launch["flags"],
                             what="the host-tier copy")
        h.stop()
    text = log.read_text(errors="replace")
    assert "init_hicache" in text and "_allocate_host_buffer" in text
    assert "_cuda_host_register" in text or "Not enough host memory available" in text


def test_the_fillers_evict_the_prompts_from_the_device_pool(tmp_path):
    ad = SGLangAdapter()
    prompts = load_prompts(None, n=6)
    n_tokens = 16
    dl = Budget(900)
    # the device pool the probe gives prompts of the bundled set's length (< 64 tokens): its floor, 1024 tokens
    sz = sizes([64] * len(prompts), n_tokens)
    assert sz["device"] == 1024
    h = ad.start_variant(_restart(), log_path=tmp_path / "server.log", budget=dl,
                         flags={"--max-total-tokens": str(sz["device"])}, what="the small-pool server")
    try:
        c = ad.client(h.url, None, timeout=300, budget=dl)
        ctx = ProbeContext(client=c, adapter=ad, att=SimpleNamespace(restart=_restart()), run_dir=tmp_path,
                           prompts=prompts, max_new_tokens=n_tokens, dl=dl)
        why = HICACHE_HIT.applies(ctx)
        cold, outs = cold_arm(ctx)
        warm = warm_arm(ctx)
        resent = evict_and_resend(c, ad, prompts, fillers(outs, sz["filler"], sz["filler_len"]), n_tokens)
        c.close()
    finally:
        h.stop()
    assert why is not None and "alloc_with_host_register" in why
    n = cold["prompt_tokens"].astype(int)
    assert (warm["cached_tokens"].astype(int) >= n - 2).all()            # no filler: served from the cache
    assert (resent["cached_tokens"].astype(int) <= 4).all()              # after the fillers: evicted
    assert resent["host_cached_tokens"].tolist() == [0] * len(prompts)   # the answers say: nothing from host
    assert resent["verify_ct"].tolist() == cold["verify_ct"].tolist()
