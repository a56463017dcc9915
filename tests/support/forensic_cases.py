"""Build diagnosis cases from a real (tiny, random) HF Llama target.

* training data: HF ``output_hidden_states`` (plus a hook for the pre-norm output of the last layer), laid out
  as SpecForge ``rows_0-2000/data_{i}.ckpt`` files (right-padded with id 0 / loss_mask 0), speculators
  ``hs_{i}.safetensors`` or a training dump;
* served data: the same target run the way SGLang would feed the draft -- prompt + greedy ``output_ids``,
  rows = prompt + ``output_ids[:-1]``, chunks chosen by SGLang's capture rules (the caller passes the
  physical tensors, usually from :func:`helpers.diagnosis.conventions.served_plan`), row-parallel layers computed
  as TP-k partial products summed in the model dtype (the reduction order of a TP-k server), shaped
  exactly like a ``/generate`` response (``meta_info.hidden_states`` prompt block + 1-D rows) or written
  as per-rank dumps;
* faults: per-rank functions (partial sums, un-reduced embedding, sharded width), rotations, norms, NaNs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from helpers.formats.dumps import write_dump

SENTENCES = [
    "the quick brown fox jumps over the lazy dog while the models draft tokens",
    "targets verify them layer by layer with hidden states and the residual stream",
    "a lazy dog and a quick fox draft the tokens while models verify",
    "the residual stream of the target feeds the draft with hidden states",
]


class TargetRunner:
    """A loaded tiny target; computes every physical tensor for a token sequence."""

    def __init__(self, target_dir: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.dir = Path(target_dir)
        self.dtype = dtype
        self.model = LlamaForCausalLM.from_pretrained(self.dir, dtype=dtype).eval()
        self.tok = AutoTokenizer.from_pretrained(self.dir)
        cfg = self.model.config
        self.n, self.H, self.vocab = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        self._cache: dict = {}

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    @torch.no_grad()
    def greedy(self, ids: list[int], m: int) -> list[int]:
        seq = list(ids)
        for _ in range(m):  # plain greedy loop (HF generate's setup costs more than these tiny forwards)
            logits = self.model(torch.tensor([seq])).logits
            seq.append(int(logits[0, -1].argmax()))
        return seq[len(ids):]

    @torch.no_grad()
    def states(self, ids: list[int], tp: int = 1) -> dict:
        """``{"embedding", "out(L)" (pre-norm, all L), "final_norm", "mid(L)", "down_parts(L)"}`` for ``ids``,
        each ``[T, H]`` in the model dtype, with row-parallel layers computed as ``tp`` partial products.
        ``mid(L)`` is the residual entering layer L's MLP and ``down_parts(L)`` the per-rank MLP partials, so
        that ``mid(L) + sum(down_parts(L)) == out(L)`` (up to rounding)."""
        key = (tuple(ids), tp)
        if key in self._cache:
            return self._cache[key]
        m = self.model
        res: dict = {}
        hooks = []

        def row_parallel(name, L):
            def hook(mod, inp, out):
                x = inp[0]
                W = mod.weight
                step = W.shape[1] // tp
                parts = [x[..., r * step:(r + 1) * step] @ W[:, r * step:(r + 1) * step].T for r in range(tp)]
                if name == "down":
                    res[f"down_parts({L})"] = [p[0].clone() for p in parts]
                total = parts[0]
                for p in parts[1:]:
                    total = total + p
                return total
            return hook

        for L, layer in enumerate(m.model.layers):
            hooks.append(layer.self_attn.o_proj.register_forward_hook(row_parallel("o", L)))
            hooks.append(layer.mlp.down_proj.register_forward_hook(row_parallel("down", L)))
            hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(
                lambda mod, inp, L=L: res.__setitem__(f"mid({L})", inp[0][0].clone())))
        hooks.append(m.model.layers[-1].register_forward_hook(
            lambda mod, inp, out: res.__setitem__("last", (out[0] if isinstance(out, tuple) else out)[0].clone())))
        try:
            hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
        finally:
            for h in hooks:
                h.remove()
        res["embedding"] = hs[0][0].clone()
        for L in range(self.n - 1):
            res[f"out({L})"] = hs[L + 1][0].clone()
        res[f"out({self.n - 1})"] = res.pop("last")
        res["final_norm"] = hs[self.n][0].clone()
        self._cache[key] = res
        return res

    def rows(self, ids: list[int], tensors: list[str], tp: int = 1) -> torch.Tensor:
        st = self.states(ids, tp)
        return torch.cat([st[t] for t in tensors], dim=-1)


@dataclass
class SampleSpec:
    prompt: list[int]
    continuation: list[int]
    output_ids: list[int]

    @property
    def training_ids(self) -> list[int]:
        return self.prompt + self.continuation

    @property
    def served_ids(self) -> list[int]:
        return self.prompt + self.output_ids[:-1]


def make_samples(runner: TargetRunner, n: int = 3, m: int = 6, cont: int = 10) -> list[SampleSpec]:
    """Prompts + greedy continuations (training) and greedy output_ids (served), like SpecForge's regenerated
    data served by the same target."""
    specs = []
    for s in SENTENCES[:n]:
        p = runner.encode(s)
        c = runner.greedy(p, cont)
        specs.append(SampleSpec(prompt=p, continuation=c, output_ids=c[:m]))
    return specs


# ------------------------------------------------------------------------------------------- training

def write_specforge(out: Path, runner: TargetRunner, specs: list[SampleSpec], tensors: list[str], *,
                    pad: int = 3, compress: bool = False, mutate: Optional[Callable] = None) -> Path:
    """SpecForge offline layout: ``rows_0-2000/data_{i}.ckpt[.gz]`` with input_ids, loss_mask,
    aux_hidden_state [1, L, C*H], hidden_state [1, L, H] (post-norm), right-padded with zeros."""
    import gzip
    import io

    d = Path(out) / "rows_0-2000"
    d.mkdir(parents=True, exist_ok=True)
    for i, sp in enumerate(specs):
        ids = sp.training_ids
        aux = runner.rows(ids, tensors)
        if mutate is not None:
            aux = mutate(i, aux)
        fin = runner.states(ids)["final_norm"]
        L = len(ids)
        lm = torch.zeros(L + pad, dtype=torch.long)
        lm[len(sp.prompt):L] = 1
        rec = {"input_ids": torch.tensor(ids + [0] * pad, dtype=torch.long), "loss_mask": lm,
               "aux_hidden_state": torch.cat([aux, torch.zeros(pad, aux.shape[1], dtype=aux.dtype)])[None],
               "hidden_state": torch.cat([fin, torch.zeros(pad, fin.shape[1], dtype=fin.dtype)])[None]}
        if compress:
            buf = io.BytesIO()
            torch.save(rec, buf)
            with gzip.open(d / f"data_{i}.ckpt.gz", "wb") as f:
                f.write(buf.getvalue())
        else:
            torch.save(rec, d / f"data_{i}.ckpt")
    return Path(out)


def write_speculators(out: Path, runner: TargetRunner, specs: list[SampleSpec], tensors: list[str]) -> Path:
    """speculators layout: flat ``hs_{i}.safetensors`` with token_ids [L] and hidden_states [L, slots, H]
    (``tensors`` are the slots; training drops the last one)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for i, sp in enumerate(specs):
        st = runner.states(sp.training_ids)
        hs = torch.stack([st[t] for t in tensors], dim=1).contiguous()
        save_file({"token_ids": torch.tensor(sp.training_ids, dtype=torch.long), "hidden_states": hs},
                  str(out / f"hs_{i}.safetensors"))
    return out


def write_reference(out: Path, runner: TargetRunner, specs: list[SampleSpec]) -> Path:
    """A reference dump holding every physical tensor (HF hidden states) for the training tokens."""
    names = ["embedding"] + [f"out({L})" for L in range(runner.n)] + ["final_norm"]
    samples = [{"key": f"ref{i}", "sample_id": f"data_{i}", "input_ids": sp.training_ids,
                "hidden": runner.rows(sp.training_ids, names)} for i, sp in enumerate(specs)]
    return write_dump(out, samples, {"kind": "reference", "hidden_size": runner.H,
                                     "layer_plan": {"tensors": names, "source": "HF output_hidden_states + hook"},
                                     "source": {"model": str(getattr(runner, "dir", "synthetic"))}})


# --------------------------------------------------------------------------------------------- served

def generate_response(rows: torch.Tensor, sp: SampleSpec, rid: str, *, with_prompt_ids: bool = True,
                      cached: int = 0) -> dict:
    """A ``/generate`` response shaped like SGLang's: ``meta_info.hidden_states`` = [prompt block (2-D,
    the rows SGLang computed: the last ``P - cached`` prompt tokens), then one 1-D row per later output
    token]; ``prompt_token_ids`` at the top level when requested."""
    P = len(sp.prompt)
    vals = rows.tolist()
    hs = [vals[cached:P]] + vals[P:]
    assert len(hs) == len(sp.output_ids)
    r = {"text": "", "output_ids": list(sp.output_ids),
         "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": len(sp.output_ids)},
                       "prompt_tokens": P, "weight_version": "default", "total_retractions": 0,
                       "completion_tokens": len(sp.output_ids), "cached_tokens": cached, "e2e_latency": 0.05,
                       "hidden_states": hs}}
    if with_prompt_ids:
        r["prompt_token_ids"] = list(sp.prompt)
    return r


def served_rows(runner: TargetRunner, sp: SampleSpec, tensors: list[str], tp: int = 1) -> torch.Tensor:
    return runner.rows(sp.served_ids, tensors, tp)


def write_generate_json(path: Path, runner: TargetRunner, specs: list[SampleSpec], tensors: list[str], *,
                        tp: int = 1, with_prompt_ids: bool = True, mutate: Optional[Callable] = None,
                        cached: int = 0) -> Path:
    """A JSON list of ``/generate`` responses in training-sample order (rank 0's rows)."""
    resp = []
    for i, sp in enumerate(specs):
        rows = served_rows(runner, sp, tensors, tp)
        if mutate is not None:
            rows = mutate(i, rows)
        resp.append(generate_response(rows, sp, f"req{i}", with_prompt_ids=with_prompt_ids, cached=cached))
    Path(path).write_text(json.dumps(resp))
    return Path(path)


def write_rank_dumps(folder: Path, runner: TargetRunner, specs: list[SampleSpec], tensors: list[str], tp: int, *,
                     rank_rows: Optional[Callable] = None, dtype_name: Optional[str] = None) -> list[Path]:
    """One per-rank dump per TP rank (kind ``per_rank``). ``rank_rows(r, sp, states) -> [T, W]`` overrides
    the replicated rows (faults)."""
    paths = []
    for r in range(tp):
        samples = []
        for i, sp in enumerate(specs):
            st = runner.states(sp.served_ids, tp)
            rows = rank_rows(r, sp, st) if rank_rows else torch.cat([st[t] for t in tensors], -1)
            samples.append({"key": f"req{i}", "input_ids": sp.served_ids, "hidden": rows.contiguous(),
                            "output_ids": sp.output_ids, "num_prompt_tokens": len(sp.prompt)})
        p = write_dump(Path(folder) / f"rank{r}", samples,
                       {"kind": "per_rank", "tp_rank": r, "tp_size": tp, "hidden_size": runner.H,
                        "sglang_version": "0.5.23", "module": "model.layers[*] aux capture"})
        paths.append(p)
    return paths


def partial_rows(runner: TargetRunner, tensors: list[str], tp: int):
    """Per-rank rows where each ``out(L)`` chunk is the rank's un-reduced share: the MLP partial product of
    the rank plus (rank 0 only) the residual -- summing the ranks gives ``out(L)``."""
    def fn(r, sp, st):
        cols = []
        for t in tensors:
            L = int(t[4:-1])
            part = st[f"down_parts({L})"][r]
            cols.append(part + st[f"mid({L})"] if r == 0 else part)
        return torch.cat(cols, -1)
    return fn


def unreduced_embedding_rows(runner: TargetRunner, tensors: list[str], tp: int):
    """Per-rank rows whose ``embedding`` chunk is the rank's vocab shard only (out-of-shard rows zero), as
    ``VocabParallelEmbedding`` gives before its all-reduce."""
    from helpers.diagnosis.detectors import _vocab_shard

    def fn(r, sp, st):
        ids = torch.tensor(sp.served_ids)
        a, b = _vocab_shard(runner.vocab, r, tp)
        cols = []
        for t in tensors:
            x = st[t]
            if t == "embedding":
                x = x * ((ids >= a) & (ids < b)).to(x.dtype)[:, None]
            cols.append(x)
        return torch.cat(cols, -1)
    return fn


def sharded_rows(runner: TargetRunner, tensors: list[str], tp: int):
    """Per-rank rows holding only the rank's H/tp columns of every chunk."""
    def fn(r, sp, st):
        w = runner.H // tp
        return torch.cat([st[t][:, r * w:(r + 1) * w] for t in tensors], -1)
    return fn


def orthogonal(H: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    return q
