"""Each op of the pure-torch ``sgl_kernel`` stand-in against an independent reference computation.

References: ``torch.nn.functional.scaled_dot_product_attention`` for attention, HF transformers'
Llama RMSNorm / rotary embedding, explicit Python loops over the EAGLE tree built from its
structural layout (``sglang/srt/speculative/spec_utils.py::select_top_k_tokens``), and gloo
collectives checked in two real processes.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support import ROOT, import_from

sgl_kernel = import_from(ROOT / "env" / "reference" / "standin", "sgl_kernel")
from sgl_kernel import speculative as spec  # noqa: E402

OPS = torch.ops.sgl_kernel
GEN = torch.Generator().manual_seed(1234)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- layers
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_rmsnorm_matches_hf_llama_rmsnorm(dtype, tol):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = randn(7, 64, dtype=dtype)
    norm = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(64))
    ref = norm.to(dtype)(x)
    out = OPS.rmsnorm_cpu(x, norm.weight.data.to(dtype), 1e-5)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_fused_add_rmsnorm_updates_both_in_place():
    x, r, w = randn(5, 32), randn(5, 32), randn(32)
    expected_residual = x + r
    expected = F.rms_norm(expected_residual, (32,), w, eps=1e-6)
    xi, ri = x.clone(), r.clone()
    assert OPS.fused_add_rmsnorm_cpu(xi, ri, w, 1e-6) is None
    torch.testing.assert_close(ri, expected_residual)
    torch.testing.assert_close(xi, expected, atol=1e-5, rtol=1e-5)


def test_silu_and_mul():
    x = randn(4, 3, 10)
    gate, up = x[..., :5], x[..., 5:]
    ref = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(OPS.silu_and_mul_cpu(x), ref)


@pytest.mark.parametrize("layout", ["2d", "3d"])
def test_rotary_neox_matches_hf_apply_rotary_pos_emb(layout):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, hq, hk, d, base = 6, 4, 2, 16, 10000.0
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(64, dtype=torch.float32), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # SGLang layout [max_pos, d]
    pos = torch.tensor([0, 1, 5, 9, 33, 63])
    q, k = randn(t, hq, d), randn(t, hk, d)
    emb = torch.cat((freqs[pos], freqs[pos]), dim=-1)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                        emb.cos()[None], emb.sin()[None])
    q_ref, k_ref = q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)
    if layout == "2d":
        q_in, k_in = q.reshape(t, -1).clone(), k.reshape(t, -1).clone()
        q_out, k_out = OPS.rotary_embedding_cpu(pos, q_in, k_in, d, cache, True)
        torch.testing.assert_close(q_in.view(t, hq, d), q_ref, atol=1e-5, rtol=1e-5)  # in place
    else:
        q_out, k_out = OPS.rotary_embedding_cpu(pos, q.clone(), k.clone(), d, cache, True)
    torch.testing.assert_close(q_out.reshape(t, hq, d), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.reshape(t, hk, d), k_ref, atol=1e-5, rtol=1e-5)


def test_rotary_gptj_interleaved_equals_complex_multiplication():
    t, h, d = 3, 2, 8
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(16, dtype=torch.float32), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    pos = torch.tensor([2, 7, 11])
    q, k = randn(t, h, d), randn(t, h, d)
    rot = torch.polar(torch.ones_like(freqs[pos]), freqs[pos])[:, None, :]
    q_ref = torch.view_as_real(torch.view_as_complex(q.reshape(t, h, d // 2, 2)) * rot).reshape(t, h, d)
    q_out, _ = OPS.rotary_embedding_cpu(pos, q, k, d, cache, False)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)


def test_weight_packed_linear_and_identity_packing():
    x, w, b = randn(5, 32), randn(48, 32), randn(48)
    packed = OPS.convert_weight_packed(w)
    assert torch.equal(packed, w)
    torch.testing.assert_close(OPS.weight_packed_linear(x, packed, b, True), x @ w.T + b)
    torch.testing.assert_close(OPS.weight_packed_linear(x, packed, None, True), x @ w.T)


def test_store_cache_scatters_rows():
    k_cache, v_cache = torch.zeros(20, 2, 4), torch.zeros(20, 2, 4)
    k, v = randn(3, 2, 4), randn(3, 2, 4)
    idx = torch.tensor([7, 2, 19])
    OPS.store_cache_cpu(k, v, k_cache, v_cache, idx, 8)
    torch.testing.assert_close(k_cache[idx], k)
    torch.testing.assert_close(v_cache[idx], v)
    assert k_cache.abs().sum() == k.abs().sum()


# ---------------------------------------------------------------- attention
def _paged_setup(lens, hkv=2, d=8, pool=64):
    """Random KV pool and a req_to_token map with scattered (permuted) slots per request."""
    k_buf, v_buf = randn(pool, hkv, d), randn(pool, hkv, d)
    perm = torch.randperm(pool, generator=GEN)
    r2t = torch.zeros(len(lens) + 1, 32, dtype=torch.int32)
    off = 0
    for b, n in enumerate(lens):
        r2t[b + 1, :n] = perm[off:off + n].to(torch.int32)
        off += n
    rpi = torch.arange(1, len(lens) + 1)
    return k_buf, v_buf, r2t, rpi


def _sdpa(q, k, v, mask, scale):
    """Reference: F.scaled_dot_product_attention with KV heads repeated for GQA.

    q [Q, Hq, D], k/v [K, Hkv, D], mask [Q, K] bool -> [Q, Hq, D]
    """
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def test_decode_attention_matches_sdpa_and_writes_kv():
    lens = [5, 11, 1]
    hq, hkv, d = 4, 2, 8
    k_buf, v_buf, r2t, rpi = _paged_setup(lens, hkv, d)
    q = randn(3, hq, d)
    k_new, v_new = randn(3, hkv, d), randn(3, hkv, d)
    loc = torch.stack([r2t[rpi[b], n - 1] for b, n in enumerate(lens)]).to(torch.int64)
    out = torch.empty(3, hq, d)
    OPS.decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, out, k_new, v_new, loc,
                             torch.zeros(3, hq, 8, d + 1), r2t, rpi, torch.tensor(lens),
                             0.3, 0.0, False, 0, None, None)
    for b, n in enumerate(lens):
        assert torch.equal(k_buf[loc[b]], k_new[b]) and torch.equal(v_buf[loc[b]], v_new[b])
        rows = r2t[rpi[b], :n].long()
        ref = _sdpa(q[b:b + 1], k_buf[rows], v_buf[rows], torch.ones(1, n, dtype=torch.bool), 0.3)
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_logit_cap():
    lens = [6]
    k_buf, v_buf, r2t, rpi = _paged_setup(lens, 1, 4)
    q = randn(1, 1, 4) * 10
    out = torch.empty(1, 1, 4)
    OPS.decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, out, None, None, torch.tensor([0]),
                             torch.zeros(1), r2t, rpi, torch.tensor(lens), 1.0, 2.0, False, 0,
                             None, None)
    rows = r2t[1, :6].long()
    s = 2.0 * torch.tanh((q[0] @ k_buf[rows, 0].T) / 2.0)
    ref = torch.softmax(s, -1) @ v_buf[rows, 0]
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_extend_attention_prefix_plus_causal_matches_sdpa(dtype, tol):
    totals, ext = [9, 4, 12], [3, 4, 1]  # second request has no prefix, third is decode-like
    hq, hkv, d = 4, 2, 8
    k_buf, v_buf, r2t, rpi = _paged_setup(totals, hkv, d)
    k_buf, v_buf = k_buf.to(dtype), v_buf.to(dtype)
    n = sum(ext)
    q, ke, ve = randn(n, hq, d, dtype=dtype), randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype)
    out = torch.zeros(n, hq, d, dtype=dtype)
    starts = torch.tensor([0, 3, 7])
    OPS.extend_attention_cpu(q, ke, ve, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor(totals),
                             torch.tensor(ext), starts, max(ext), 0.25, 0.0, False, 0, None, None,
                             None, True)
    for b in range(3):
        p = totals[b] - ext[b]
        s = int(starts[b])
        rows = r2t[rpi[b], :p].long()
        k = torch.cat((k_buf[rows], ke[s:s + ext[b]])).float()
        v = torch.cat((v_buf[rows], ve[s:s + ext[b]])).float()
        mask = torch.ones(ext[b], totals[b], dtype=torch.bool)
        mask[:, p:] = torch.tril(torch.ones(ext[b], ext[b], dtype=torch.bool))
        ref = _sdpa(q[s:s + ext[b]].float(), k, v, mask, 0.25)
        torch.testing.assert_close(out[s:s + ext[b]].float(), ref, atol=tol, rtol=tol)


def test_extend_attention_tree_mask_matches_sdpa():
    bs, nd, prefix = 2, 4, [5, 3]
    hq, hkv, d = 2, 2, 8
    totals = [p + nd for p in prefix]
    k_buf, v_buf, r2t, rpi = _paged_setup(totals, hkv, d)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    tree2 = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    mask = torch.stack((tree, tree2)).flatten()
    q, ke, ve = randn(bs * nd, hq, d), randn(bs * nd, hkv, d), randn(bs * nd, hkv, d)
    out = torch.zeros(bs * nd, hq, d)
    OPS.extend_attention_cpu(q, ke, ve, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor(totals),
                             torch.full((bs,), nd), torch.tensor([0, nd]), nd, 0.5, 0.0, False, 0,
                             None, None, mask, True)
    for b, tm in enumerate((tree, tree2)):
        rows = r2t[rpi[b], :prefix[b]].long()
        sl = slice(b * nd, (b + 1) * nd)
        k = torch.cat((k_buf[rows], ke[sl]))
        v = torch.cat((v_buf[rows], ve[sl]))
        full = torch.cat((torch.ones(nd, prefix[b], dtype=torch.bool), tm), dim=1)
        torch.testing.assert_close(out[sl], _sdpa(q[sl], k, v, full, 0.5), atol=1e-5, rtol=1e-5)


def test_attention_unsupported_features_raise():
    k_buf, v_buf, r2t, rpi = _paged_setup([3], 1, 4)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        OPS.decode_attention_cpu(randn(1, 1, 4), k_buf, v_buf, 1.0, 1.0, torch.empty(1, 1, 4),
                                 None, None, torch.tensor([0]), torch.zeros(1), r2t, rpi,
                                 torch.tensor([3]), 1.0, 0.0, False, 128, None, None)


def test_extend_attention_mha_prefill_over_mla_pool_matches_sdpa():
    """DeepSeek's MHA prefill: q/k [T, H, nope + rope], v [T, H, v_head] while the pool holds MLA rows
    [N, 1, kv_lora + rope] (v a narrow view of k); no cached prefix, so the pool is not read."""
    lens, h, dqk, dv = [5, 3], 4, 24, 16
    pool_k = randn(64, 1, 72)
    pool_v = pool_k[..., :64]
    before = pool_k.clone()
    _, _, r2t, rpi = _paged_setup(lens, 1, 72)
    n = sum(lens)
    q, k, v = randn(n, h, dqk), randn(n, h, dqk), randn(n, h, dv)
    out = torch.zeros(n, h, dv)
    starts = torch.tensor([0, 5])
    OPS.extend_attention_cpu(q, k, v, out, pool_k, pool_v, 1.0, 1.0, r2t, rpi, torch.tensor(lens),
                             torch.tensor(lens), starts, max(lens), 0.2, 0.0, False, 0, None, None, None, True)
    for b, m in enumerate(lens):
        sl = slice(int(starts[b]), int(starts[b]) + m)
        causal = torch.tril(torch.ones(m, m, dtype=torch.bool))
        torch.testing.assert_close(out[sl], _sdpa(q[sl], k[sl], v[sl], causal, 0.2), atol=1e-5, rtol=1e-5)
    assert torch.equal(pool_k, before)      # the op does not write the pool (set_kv_buffer does)
    # a cached prefix in a pool laid out unlike the extend tensors cannot be attended to: a clear error
    with pytest.raises(ValueError, match="pool layout"):
        OPS.extend_attention_cpu(q[:2], k[:2], v[:2], out[:2], pool_k, pool_v, 1.0, 1.0, r2t, rpi,
                                 torch.tensor([4]), torch.tensor([2]), torch.tensor([0]), 2, 0.2, 0.0, False, 0,
                                 None, None, None, True)


def _mla_pool(lens, kv_lora=16, rope=8, pool=64):
    """An MLA KV pool as MLATokenToKVPool lays it out (sglang/srt/mem_cache/memory_pool.py): one buffer
    [N, 1, kv_lora + rope], the value buffer its first kv_lora columns (a view)."""
    k_buf = randn(pool, 1, kv_lora + rope)
    _, _, r2t, rpi = _paged_setup(lens, 1, kv_lora + rope, pool)
    return k_buf, k_buf[..., :kv_lora], r2t, rpi


def test_decode_attention_mla_shapes_match_sdpa_and_write_through_the_view():
    """Absorbed MLA decode: MQA with Hkv 1, D = kv_lora + rope, Dv = kv_lora (forward_mla.py -> attn_mqa)."""
    lens, hq, kv_lora, rope = [4, 9], 8, 16, 8
    k_buf, v_buf, r2t, rpi = _mla_pool(lens, kv_lora, rope)
    q = randn(2, hq, kv_lora + rope)
    k_new = randn(2, 1, kv_lora + rope)
    loc = torch.stack([r2t[rpi[b], n - 1] for b, n in enumerate(lens)]).to(torch.int64)
    out = torch.empty(2, hq, kv_lora)
    OPS.decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, out, k_new, k_new[..., :kv_lora], loc,
                             torch.zeros(2, hq, 8, kv_lora + 1), r2t, rpi, torch.tensor(lens), 0.3, 0.0, False, 0,
                             None, None)
    for b, n in enumerate(lens):
        assert torch.equal(k_buf[loc[b]], k_new[b])
        rows = r2t[rpi[b], :n].long()
        kk = k_buf[rows, 0]
        probs = torch.softmax((q[b] @ kk.T) * 0.3, dim=-1)                 # naive MQA: every head, one KV head
        torch.testing.assert_close(out[b], probs @ kk[:, :kv_lora], atol=1e-5, rtol=1e-5)


def test_extend_attention_mla_shapes_with_prefix_match_naive():
    """Absorbed MLA extend (target verify / draft extend): prefix rows from the MLA pool, extend rows given."""
    totals, ext, hq, kv_lora, rope = [7, 5], [3, 5], 4, 16, 8
    k_buf, v_buf, r2t, rpi = _mla_pool(totals, kv_lora, rope)
    n = sum(ext)
    q, ke = randn(n, hq, kv_lora + rope), randn(n, 1, kv_lora + rope)
    out = torch.zeros(n, hq, kv_lora)
    starts = torch.tensor([0, 3])
    OPS.extend_attention_cpu(q, ke, ke[..., :kv_lora], out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor(totals),
                             torch.tensor(ext), starts, max(ext), 0.25, 0.0, False, 0, None, None, None, True)
    for b in range(2):
        p, s, m = totals[b] - ext[b], int(starts[b]), ext[b]
        kk = torch.cat((k_buf[r2t[rpi[b], :p].long(), 0], ke[s:s + m, 0]))
        scores = (q[s:s + m] @ kk.T) * 0.25                                 # [m, Hq, p + m]
        mask = torch.ones(m, p + m, dtype=torch.bool)
        mask[:, p:] = torch.tril(torch.ones(m, m, dtype=torch.bool))
        probs = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
        torch.testing.assert_close(out[s:s + m], probs @ kk[:, :kv_lora], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- MoE routing
def _hf_router(e, groups, topk_group, topk, norm, rsf, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=e, n_group=groups, topk_group=topk_group,
                           num_experts_per_tok=topk, norm_topk_prob=norm, routed_scaling_factor=rsf)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(e, generator=g) * 0.5)
    return router


@pytest.mark.parametrize("e,groups,topk_group,topk,norm", [(8, 1, 1, 2, True), (16, 4, 2, 3, True),
                                                           (64, 8, 3, 6, False), (8, 2, 1, 2, True)])
def test_biased_grouped_topk_matches_hf_deepseek_v3_router(e, groups, topk_group, topk, norm):
    """The DeepSeek-V3 noaux_tc router: same experts and weights as HF's DeepseekV3TopkRouter (sigmoid, bias
    for the choice only, group top-2 sums, renormalised with +1e-20, times routed_scaling_factor)."""
    rsf = 2.827
    router = _hf_router(e, groups, topk_group, topk, norm, rsf, seed=e + groups)
    x = randn(37, 32)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    bias = router.e_score_correction_bias.clone()
    w, ids = OPS.biased_grouped_topk_cpu(x, logits, bias, topk, norm, groups, topk_group, 0, rsf,
                                         num_token_non_padded=None)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (37, topk)
    dense, ref = torch.zeros(37, e), torch.zeros(37, e)
    dense.scatter_(1, ids.long(), w)
    ref.scatter_(1, ref_ids.long(), ref_w)
    torch.testing.assert_close(dense, ref, atol=1e-6, rtol=1e-6)
    # without the scaling factor (SGLang passes None unless the router applies it): weights / rsf
    w1, ids1 = OPS.biased_grouped_topk_cpu(x, logits, bias, topk, norm, groups, topk_group, 0, None)
    assert torch.equal(ids1, ids)
    torch.testing.assert_close(w1 * rsf, w, atol=1e-6, rtol=1e-6)


def test_biased_grouped_topk_bias_changes_the_choice_not_the_weight():
    """A large bias on one expert makes it chosen for every token while its weight stays its own sigmoid score:
    the correction bias only steers selection (DeepSeek-V3's auxiliary-loss-free balancing)."""
    logits = randn(10, 8)
    bias = torch.zeros(8)
    bias[5] = 10.0
    w, ids = OPS.biased_grouped_topk_cpu(torch.zeros(10, 4), logits, bias, 2, False, 1, 1)
    assert (ids == 5).any(dim=1).all()
    pos = (ids == 5).long().argmax(dim=1)
    torch.testing.assert_close(w[torch.arange(10), pos], logits[:, 5].sigmoid())
    with pytest.raises(NotImplementedError, match="fused shared experts"):
        OPS.biased_grouped_topk_cpu(torch.zeros(10, 4), logits, bias, 2, False, 1, 1, 1)


def test_boot_hook_makes_cuda_synchronize_a_no_op_on_cpu_torch():
    """kimi_k25_eagle3.py's set_embed calls torch.cuda.synchronize(); CPU torch raises there unless the boot hook
    (E3F_STANDIN_AMX=1) replaced it. Run in fresh interpreters: with and without the variable."""
    import os
    import subprocess
    import sys

    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch: the hook leaves torch.cuda alone")
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); import torch; torch.cuda.synchronize(); "
            "print('synchronized')")
    boot = str(ROOT / "env" / "reference" / "standin" / "e3f_boot.py")
    env = {k: v for k, v in os.environ.items() if k not in ("E3F_STANDIN_AMX", "E3F_LOOPBACK_STORE")}
    off = subprocess.run([sys.executable, "-c", code, boot], env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode != 0 and "not compiled with CUDA" in off.stderr
    on = subprocess.run([sys.executable, "-c", code, boot], env={**env, "E3F_STANDIN_AMX": "1"},
                        capture_output=True, text=True, timeout=120)
    assert on.returncode == 0 and on.stdout.strip() == "synchronized", on.stderr[-2000:]


def test_boot_hook_canary_shims_only_with_their_test_variable():
    """E3F_TEST_CANARY_CPU=1 (test-only, bench/bench_integrity.py): SGLang's KV canary asks torch.cpu.Stream for a
    device and pins host memory; without the variable both fail on CPU torch as they do in SGLang, with it a stream
    is made and the host copy is an ordinary tensor of the same values."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CUDA device: pinned memory works and the hook leaves torch alone")
    code = ("import runpy, sys; runpy.run_path(sys.argv[1]); import torch; "
            "s = torch.cpu.Stream(device=torch.device('cpu')); "
            "t = torch.tensor([3, 4], pin_memory=True).pin_memory(); e = torch.empty(2, pin_memory=True); "
            "print(t.tolist(), tuple(e.shape))")
    boot = str(ROOT / "env" / "reference" / "standin" / "e3f_boot.py")
    env = {k: v for k, v in os.environ.items() if k not in ("E3F_STANDIN_AMX", "E3F_LOOPBACK_STORE",
                                                            "E3F_TEST_CANARY_CPU")}
    off = subprocess.run([sys.executable, "-c", code, boot], env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode != 0 and "unexpected keyword argument 'device'" in off.stderr
    on = subprocess.run([sys.executable, "-c", code, boot], env={**env, "E3F_TEST_CANARY_CPU": "1"},
                        capture_output=True, text=True, timeout=120)
    assert on.returncode == 0 and on.stdout.strip() == "[3, 4] (2,)", on.stderr[-2000:]


# ---------------------------------------------------------------- EAGLE tree
def _eagle_tree_inputs(bs, topk, depth, n, seed):
    """(parent_list, top_scores_index, parent_of) laid out as SGLang's select_top_k_tokens and
    organize_draft_results produce them (sglang/srt/speculative/spec_utils.py, eagle_utils.py).

    Candidate ids: step 0 children of the root are 0..topk-1; at step s >= 1 the children of the
    p-th node chosen at step s-1 are ``topk + (s-1)*topk*topk + p*topk + c``. The selected set is
    closed under parents (a child's cumulative score never exceeds its parent's), sorted.
    ``parent_of[b][cand]`` is the structural parent candidate (-1 = root), derived from the layout
    and not from ``parent_list``.
    """
    g = torch.Generator().manual_seed(seed)
    parent_lists, selected, parent_of = [], [], []
    for _ in range(bs):
        chosen = [list(range(topk))]
        par = {c: -1 for c in range(topk)}
        plist = list(range(-1, topk))
        for step in range(1, depth):
            base = topk + (step - 1) * topk * topk
            for p_idx, p in enumerate(chosen[-1]):
                for c in range(topk):
                    par[base + p_idx * topk + c] = p
            pick = torch.randperm(topk * topk, generator=g)[:topk].sort().values.tolist()
            chosen.append([base + x for x in pick])
            if step < depth - 1:
                plist += chosen[-1]
        expandable = set(x for step in chosen for x in step)
        sel: list[int] = []
        while len(sel) < n - 1:
            frontier = [c for c, p in par.items() if c not in sel and (p == -1 or (p in sel and p in expandable))]
            sel.append(frontier[int(torch.randint(len(frontier), (1,), generator=g))])
        parent_lists.append(plist)
        selected.append(sorted(sel))
        parent_of.append(par)
    return torch.tensor(parent_lists), torch.tensor(selected), parent_of


def _closed_tree_inputs(topk=2, depth=3, n=5, bs=3):
    return _eagle_tree_inputs(bs, topk, depth, n, seed=3)


TREES = [(2, 3, 5), (2, 4, 8), (3, 3, 7), (1, 3, 4)]  # (topk, depth = steps, draft tokens)


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("topk,depth,n", TREES)
def test_build_tree_matches_structural_reference(mode, topk, depth, n):
    bs = 3
    parent_list, sel, par = _closed_tree_inputs(topk, depth, n, bs)
    seq_lens = torch.tensor([7, 3, 10])
    if mode == 1:
        mask = torch.full((bs * n * n,), True)
    else:
        mask = torch.full((int(seq_lens.sum()) * n + bs * n * n,), True)
    positions = torch.empty(bs * n, dtype=torch.long)
    ri, rnt, rns = torch.full((3, bs, n), -1, dtype=torch.long)
    sgl_kernel.build_tree_kernel_efficient_cpu(parent_list, sel, seq_lens, mask, positions, ri,
                                               rnt, rns, topk, depth, n, mode)
    off = 0
    for b in range(bs):
        s = sel[b].tolist()
        node = {c: i + 1 for i, c in enumerate(s)}  # candidate -> tree node (0 = root/bonus)
        parent_node = {i + 1: (0 if par[b][c] == -1 else node[par[b][c]]) for i, c in enumerate(s)}

        def ancestors(t):
            out = {0, t}
            while t:
                t = parent_node[t]
                out.add(t)
            return out

        for t in range(n):
            want = [j in ancestors(t) for j in range(n)]
            if mode == 1:
                row = mask[(b * n + t) * n:(b * n + t + 1) * n]
            else:
                start = off + b * n * n + (int(seq_lens[b]) + n) * t
                row = mask[start + int(seq_lens[b]):start + int(seq_lens[b]) + n]
                assert mask[start:start + int(seq_lens[b])].all()  # prefix stays visible
            assert row.tolist() == want, (b, t)
            assert positions[b * n + t] == int(seq_lens[b]) + len(ancestors(t)) - 1
        children = {p: sorted(c for c, q in parent_node.items() if q == p) for p in range(n)}
        for p in range(n):
            kids = children[p]
            assert rnt[b, p] == (kids[0] if kids else -1)
            for a, nxt in zip(kids, kids[1:] + [-1]):
                assert rns[b, a] == nxt
        assert ri[b].tolist() == list(range(b * n, (b + 1) * n))
        off += int(seq_lens[b]) * n


def _walk_reference(children, cand, target, n_spec):
    """Greedy acceptance by explicit tree walk: from the root, take the first child (in index
    order) whose draft token equals the target's prediction at the current node."""
    node, path = 0, [0]
    while len(path) < n_spec:
        nxt = [c for c in children.get(node, []) if cand[c] == target[node]]
        if not nxt:
            break
        node = nxt[0]
        path.append(node)
    return path


@pytest.mark.parametrize("topk,depth,n", TREES)
def test_verify_tree_greedy_matches_tree_walk(topk, depth, n):
    bs = 3
    parent_list, sel, _ = _closed_tree_inputs(topk, depth, n, bs)
    seq_lens = torch.tensor([4, 4, 4])
    ri, rnt, rns = torch.full((3, bs, n), -1, dtype=torch.long)
    sgl_kernel.build_tree_kernel_efficient_cpu(parent_list, sel, seq_lens,
                                               torch.full((bs * n * n,), True),
                                               torch.empty(bs * n, dtype=torch.long), ri, rnt, rns,
                                               topk, depth, n, 1)
    g = torch.Generator().manual_seed(7)
    for trial in range(20):
        cand = torch.randint(0, 3, (bs, n), generator=g)
        target = torch.randint(0, 3, (bs, n), generator=g)
        predicts = torch.full((bs * n,), -7, dtype=torch.int32)
        accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        sgl_kernel.verify_tree_greedy_cpu(predicts=predicts, accept_index=accept_index,
                                          accept_token_num=accept_num, candidates=cand,
                                          retrive_index=ri, retrive_next_token=rnt,
                                          retrive_next_sibling=rns, target_predict=target)
        for b in range(bs):
            children = {}
            for c in range(1, n):
                # parent of node c: the node whose first-child/sibling chain contains c
                for p in range(n):
                    k = int(rnt[b, p])
                    while k != -1:
                        if k == c:
                            children.setdefault(p, []).append(c)
                        k = int(rns[b, k])
            path = _walk_reference({p: sorted(v) for p, v in children.items()}, cand[b].tolist(),
                                   target[b].tolist(), depth + 1)
            assert accept_num[b] == len(path) - 1, trial
            assert accept_index[b, :len(path)].tolist() == [b * n + x for x in path]
            assert (accept_index[b, len(path):] == -1).all()
            for x in path:
                assert predicts[b * n + x] == target[b, x]


def test_cache_loc_bookkeeping():
    r2t = torch.arange(4 * 16, dtype=torch.int32).reshape(4, 16) * 10
    rpi = torch.tensor([2, 0])
    # assign_req_to_token_pool: scatter fresh slots
    r2 = r2t.clone()
    spec.assign_req_to_token_pool_cpu(rpi, r2, torch.tensor([3, 5]), torch.tensor([5, 8]),
                                      torch.tensor([101, 102, 201, 202, 203]), 16)
    assert r2[2, 3:5].tolist() == [101, 102] and r2[0, 5:8].tolist() == [201, 202, 203]
    assert torch.equal(r2[1], r2t[1])
    # assign_extend_cache_locs: gather
    out = torch.empty(5, dtype=torch.int64)
    spec.assign_extend_cache_locs_cpu(rpi, r2t, torch.tensor([1, 4]), torch.tensor([3, 7]), out, 16)
    assert out.tolist() == [r2t[2, 1].item(), r2t[2, 2].item(), r2t[0, 4].item(),
                            r2t[0, 5].item(), r2t[0, 6].item()]
    # assign_draft_cache_locs_contiguous: topk*steps slots from seq_len on
    out = torch.empty(2 * 2 * 3, dtype=torch.int64)
    spec.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, torch.tensor([2, 6]), out, 16, 2, 3)
    assert out.tolist() == r2t[2, 2:8].tolist() + r2t[0, 6:12].tolist()
    # build_draft_decode_metadata: prefix + candidate's own slots
    meta = spec.build_draft_decode_metadata_cpu(r2t, rpi, torch.tensor([2, 6]), 2, 3, 16)
    assert meta.shape == (4, 16)
    assert meta[1, :5].tolist() == r2t[2, :2].tolist() + r2t[2, 5:8].tolist()
    assert meta[2, :9].tolist() == r2t[0, :6].tolist() + r2t[0, 6:9].tolist()
    # fill_bonus_tokens / fill_accept_out_cache_loc
    acc_tok = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    spec.fill_bonus_tokens_cpu(acc_tok, torch.tensor([3, 1], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [7, 9]
    acc_idx = torch.tensor([0, 2, -1, 4, -1, -1], dtype=torch.int32)
    ocl = torch.arange(100, 108, dtype=torch.int64)
    dst = torch.full((3,), -1, dtype=torch.int64)
    spec.fill_accept_out_cache_loc_cpu(acc_idx, ocl, dst)
    assert dst.tolist() == [100, 102, 104]


def test_copy_all_layer_kv_cache_reads_all_sources_before_writing():
    layers = [torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6),
              torch.arange(8 * 3, dtype=torch.bfloat16).reshape(8, 3)]
    before = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 7])  # overlapping: 2 and 3 are both
    spec.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for t, b in zip(layers, before):
        assert torch.equal(t[[2, 3, 7]], b[[1, 2, 3]])
        assert torch.equal(t[[0, 1, 4, 5, 6]], b[[0, 1, 4, 5, 6]])


# ---------------------------------------------------------------- collectives, misc
def _collective_worker(rank, world, port, q, use_shm):
    import os

    import torch.distributed as dist

    # the spawned process imports this module to find this function, and with it the stand-in (above)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), E3F_SHM_KEY=f"test-{port}")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if use_shm:
        torch.ops.sgl_kernel.initialize(world, rank)
        assert sgl_kernel.comm._state["shm"] is not None
    x = torch.full((2, 3), float(rank + 1), dtype=torch.bfloat16)
    torch.ops.sgl_kernel.shm_allreduce(x, 0)
    g = torch.ops.sgl_kernel.shm_allgather(torch.full((1, 2), float(rank)), 0)
    q.put((rank, x.float().tolist(), g.tolist()))
    dist.destroy_process_group()


@pytest.mark.parametrize("use_shm", [False, True], ids=["gloo", "shared-memory"])
def test_shm_collectives(use_shm):
    import os

    import torch.multiprocessing as mp

    from helpers.server.embedded import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_worker, args=(r, 2, port, q, use_shm)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, reduced, gathered in results:
        assert reduced == [[3.0] * 3] * 2
        assert gathered == [[0.0, 0.0], [1.0, 1.0]]
    assert not [f for f in os.listdir("/dev/shm") if f.endswith(f"test-{port}-tp2")]  # unlinked


def test_init_cpu_threads_env_binds_threads():
    import os

    before_threads, before_aff = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        msg = OPS.init_cpu_threads_env("0")
        assert "CPUs [0]" in msg and torch.get_num_threads() == 1
        assert os.sched_getaffinity(0) == {0}
    finally:
        os.sched_setaffinity(0, before_aff)
        torch.set_num_threads(before_threads)


def test_uncovered_ops_raise_not_implemented_naming_the_op():
    with pytest.raises(NotImplementedError, match="apply_rotary_pos_emb_cpu"):
        OPS.apply_rotary_pos_emb_cpu(randn(1), randn(1), randn(1), randn(1))
    from sgl_kernel import fused_experts_cpu  # importing is fine (SGLang imports far more)

    with pytest.raises(NotImplementedError, match="fused_experts_cpu"):
        fused_experts_cpu(randn(1))
    from sgl_kernel.kvcacheio import transfer_kv_all_layer

    with pytest.raises(NotImplementedError, match="kvcacheio.transfer_kv_all_layer"):
        transfer_kv_all_layer()
    assert not hasattr(OPS, "gptq_marlin_repack")  # SGLang's hasattr probes must see it absent
    assert not hasattr(OPS, "fused_qk_norm_cpu")
