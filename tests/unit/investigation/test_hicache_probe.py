"""The host-tier probe (``hicache_hit``) without a server: a fake engine with a two-tier prefix cache (a device pool of
the size the copy's flags give, LRU, evicting to a host store; a hit on a host entry loads it back and says so in
``meta_info.cached_tokens_details``, as SGLang 0.5.23's answers do), whose draft accepts what the test says per tier;
the adapters' launch and refusals (SGLang on CPU, without a prefix cache; vLLM)."""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter
from helpers.investigation.probes import ProbeContext, run_probes
from helpers.investigation.probes.hicache import fillers, host_tokens, sizes
from helpers.server.protocol import GenerateResult

PROMPT_TOKENS = 40


class TieredEngine:
    """A greedy engine whose prefix cache has a device tier of ``device`` tokens (LRU; an evicted entry moves to a host
    store) and a host tier. A request for a cached prompt reports its ``cached_tokens`` (prompt length - 1) split by
    tier (``cached_tokens_details``: where the entry was when the request came; a host entry is loaded back to the
    device). ``accepted(i, tier)``: accepted drafts per verify step of prompt ``i``'s answer (3 drafts per step;
    tier None cold, ``device`` or ``host``). ``details=False``: the answers carry no per-tier split."""

    def __init__(self, accepted, device=10_000, *, details=True, evicts=True):
        self.accepted, self.device, self.details, self.evicts = accepted, device, details, evicts
        self.dev: OrderedDict = OrderedDict()
        self.host: dict = {}
        self.timeout, self.flushes, self.sent = 5.0, 0, []

    def server_info(self, refresh=False):
        return {"disable_radix_cache": False, "device": "cuda", "speculative_algorithm": "EAGLE3"}

    def flush_cache(self):
        self.dev.clear()
        self.host.clear()
        self.flushes += 1

    def close(self):
        pass

    def _insert(self, key, n):
        self.dev[key] = n
        self.dev.move_to_end(key)
        while self.evicts and sum(self.dev.values()) > self.device:
            old, m = self.dev.popitem(last=False)
            self.host[old] = m

    def generate(self, text=None, input_ids=None, sampling_params=None, max_new_tokens=None, **kw):
        key = text if text is not None else tuple(input_ids)
        n = PROMPT_TOKENS if text is not None else len(input_ids)
        tier = "device" if key in self.dev else "host" if key in self.host else None
        self.host.pop(key, None)
        self._insert(key, n)
        self.sent.append((key, max_new_tokens, tier))
        cached = n - 1 if tier else 0
        meta = {"prompt_tokens": n, "cached_tokens": cached}
        if tier and self.details:
            meta["cached_tokens_details"] = {"device": cached if tier == "device" else 0,
                                             "host": cached if tier == "host" else 0}
        if max_new_tokens < 2:
            return GenerateResult.model_validate({"output_ids": [5 + len(self.sent) % 50], "latency_s": 0.01,
                                                  "meta_info": {**meta, "completion_tokens": 1}})
        i = int(str(key).split("|")[0])
        a = self.accepted(i, tier)
        steps = -(-(max_new_tokens - 1) // (a + 1))
        ct = 1 + steps * (a + 1)
        meta.update(completion_tokens=ct, spec_verify_ct=steps, spec_num_correct_drafts=steps * a,
                    spec_num_proposed_drafts=steps * 3, spec_accept_length=ct / steps)
        return GenerateResult.model_validate({"output_ids": [10 + (i * 31 + k) % 90 for k in range(ct)],
                                              "meta_info": meta, "latency_s": 0.01})


class TierCopies:
    """An adapter whose restarted copy is a :class:`TieredEngine` built from the copy's flags (its device pool from
    ``--max-total-tokens``), on the real SGLang adapter's ``host_cache_launch``."""

    label = "SGLang"
    prefix_cache_off = staticmethod(SGLangAdapter().prefix_cache_off)
    top_logprobs_fields = staticmethod(lambda n: None)
    host_cache_launch = staticmethod(SGLangAdapter().host_cache_launch)

    def __init__(self, make):
        self.make, self.started, self.stopped, self.copy = make, [], 0, None

    def start_variant(self, restart, *, flags=None, env=None, **kw):
        self.started.append(dict(flags or {}))

        def stop():
            self.stopped += 1
        return SimpleNamespace(url="fake://copy", stop=stop)

    def client(self, url, api_key=None, **kw):
        self.copy = self.make(int(self.started[-1]["--max-total-tokens"]))
        return self.copy


def _ctx(tmp_path, live, adapter, n=8):
    prompts = load_prompts([{"id": f"p{i}", "text": f"{i}|prompt {i}"} for i in range(n)])
    return ProbeContext(client=live, adapter=adapter, att=SimpleNamespace(restart={"kind": "embedded"}),
                        run_dir=tmp_path, prompts=prompts, max_new_tokens=25, dl=Budget(600.0))


def _run(tmp_path, make, n=8):
    adapter = TierCopies(make)
    st = run_probes(_ctx(tmp_path, TieredEngine(lambda i, t: 2), adapter, n), "all", only=["hicache_hit"])
    (r,) = st["probes"]
    return r, adapter


def test_a_clean_host_restore_is_clear_and_every_prompt_came_back_from_host(tmp_path):
    r, ad = _run(tmp_path, lambda dev: TieredEngine(lambda i, t: 1 + i % 3, dev))
    assert r["status"] == "ran" and r["decision"] == "clear", r
    assert r["loss"]["delta"] == 0 and r["loss"]["n"] == 8
    ev = r["evidence"]
    assert ev["host_cached_tokens"] == {"min": PROMPT_TOKENS - 1, "max": PROMPT_TOKENS - 1,
                                        "prompts_with_host_hit": 8, "prompts_reported": 8}
    # the copy: the host tier on, a device pool of the computed size, the copy stopped
    flags = ad.started[0]
    assert "--enable-hierarchical-cache" in flags and flags["--enable-hierarchical-cache"] is None
    assert int(flags["--max-total-tokens"]) == ev["device_tokens"] == sizes([PROMPT_TOKENS] * 8, 25)["device"]
    assert float(flags["--hicache-ratio"]) * ev["device_tokens"] >= ev["host_tokens"] and ad.stopped == 1
    # the copy's requests: cold (each after a flush), one token each, fillers, then the measured resends from host
    sent = ad.copy.sent
    assert [t for _, m, t in sent[:8]] == [None] * 8 and all(m == 25 for _, m, _ in sent[:8])
    assert [m for _, m, _ in sent[8:16]] == [1] * 8
    fill = sent[16:-8]
    assert len(fill) == ev["filler_prompts"] and sum(len(k) for k, _, _ in fill) >= 3 * ev["device_tokens"]
    assert [t for _, m, t in sent[-8:]] == ["host"] * 8 and ad.copy.flushes == 9


def test_a_draft_kv_not_restored_from_host_counts(tmp_path):
    # the public report's fault: the host restore brings the target's KV back, the draft's slots hold stale KV
    r, _ = _run(tmp_path, lambda dev: TieredEngine(lambda i, t: 0 if t == "host" else 2, dev))
    assert r["decision"] == "counts" and r["loss"]["delta"] > 1.0 and r["loss"]["ci"][0] > 0.5
    (f,) = r["findings"]
    assert f["kind"] == "cache_state_loses_acceptance" and "host-memory cache tier" in f["detail"]
    assert r["evidence"]["condition_accept_length"] < r["evidence"]["cold_accept_length"]


def test_only_prompts_the_server_says_came_from_host_are_measured(tmp_path):
    # a device pool too large to evict half of them: those are device hits and stay out of the loss
    def make(dev):
        eng = TieredEngine(lambda i, t: 0 if t == "host" else 2, dev)
        real = eng._insert

        def insert(key, n):                     # prompts 4..7 never leave the device
            real(key, n)
            for k in [k for k in eng.host if isinstance(k, str) and int(k.split("|")[0]) >= 4]:
                eng.dev[k] = eng.host.pop(k)
        eng._insert = insert
        return eng
    r, _ = _run(tmp_path, make)
    assert r["evidence"]["host_cached_tokens"]["prompts_with_host_hit"] == 4 and r["loss"]["n"] == 4
    assert r["decision"] == "counts" and "the 4 whose answers say so" in r["loss"]["basis"]


def test_no_host_hit_is_undecided_never_clear(tmp_path):
    r, _ = _run(tmp_path, lambda dev: TieredEngine(lambda i, t: 2, dev, evicts=False))
    assert r["status"] == "ran" and r["decision"] == "undecided" and r["findings"] == []
    assert "host path did not happen" in r["why"] and r["evidence"]["host_cached_tokens"]["prompts_with_host_hit"] == 0
    r, _ = _run(tmp_path / "b", lambda dev: TieredEngine(lambda i, t: 0 if t == "host" else 2, dev, details=False))
    assert r["decision"] == "undecided" and "no per-tier cached-token split" in r["why"]
    assert r["findings"] == []                  # a loss without the server's word is no finding


def test_skipped_on_cpu_without_prefix_cache_on_vllm_and_for_short_prompts(tmp_path):
    sg = SGLangAdapter()
    launch, why = sg.host_cache_launch({"device": "cpu"}, device_tokens=1024, host_tokens=4096)
    assert launch is None and "alloc_with_host_register" in why and "torch.cuda.cudart" in why
    launch, why = sg.host_cache_launch({"device": "cuda", "disable_radix_cache": True}, device_tokens=1, host_tokens=1)
    assert launch is None and "--disable-radix-cache" in why
    launch, why = sg.host_cache_launch({"device": "cuda"}, device_tokens=2048, host_tokens=9000)
    assert why is None and launch["flags"]["--hicache-ratio"] == "5" and launch["flags"]["--max-total-tokens"] == "2048"
    launch, why = VLLMAdapter().host_cache_launch({}, device_tokens=1024, host_tokens=4096)
    assert launch is None and "--kv-offloading-size" in why

    live = TieredEngine(lambda i, t: 2)
    live.server_info = lambda refresh=False: {"disable_radix_cache": False, "device": "cpu"}
    ad = TierCopies(lambda dev: TieredEngine(lambda i, t: 2, dev))
    (r,) = run_probes(_ctx(tmp_path, live, ad), "all", only=["hicache_hit"])["probes"]
    assert r["status"] == "skipped" and "CPU server" in r["why"] and ad.started == []
    (r,) = run_probes(_ctx(tmp_path, live, ad), "cheap", only=["hicache_hit"])["probes"]
    assert r["status"] == "skipped" and "--engine-probes all" in r["why"]


def test_helpers_read_the_tier_split_and_build_distinct_fillers():
    ans = lambda meta: GenerateResult.model_validate({"output_ids": [1], "meta_info": meta})  # noqa: E731
    assert host_tokens(ans({"cached_tokens": 30, "cached_tokens_details": {"device": 2, "host": 28}})) == 28
    assert host_tokens(ans({"cached_tokens": 0})) == 0
    assert host_tokens(ans({"cached_tokens": 30})) is None and host_tokens(None) is None
    f = fillers([[3, 4, 5, 6, 7], [8, 9, 10, 11]], total=100, length=16)
    assert len(f) == 7 and all(len(x) == 16 for x in f) and sum(map(len, f)) >= 100
    assert len({tuple(x[:3]) for x in f}) == len(f)                     # no two share their first three tokens
    s = sizes([40, 300], 64)
    assert s["device"] == 4 * (300 + 64 + 64) and s["filler"] == 3 * s["device"]
