"""Synthetic deep targets with the statistics of real residual streams, for validating the diagnosis.

A tiny trained model (8 layers, 128 wide) is a poor test bed: every layer differs a lot from its neighbours,
so a comparison that only works on such data proves little. :class:`SyntheticTarget` produces, for any token
sequence, every physical tensor of a deep target (``embedding``, ``out(0)`` .. ``out(n-1)``, ``final_norm``,
plus the TP pieces ``mid(L)`` / ``down_parts(L)``) with the properties that make real data hard:

* **adjacent layers are close**: the median row cosine of ``out(L)`` vs ``out(L+1)`` lies in
  ``cos_adjacent`` (default 0.90-0.99, the range reported for 30-80 layer targets), and row norms grow by
  ``norm_growth`` per layer;
* **massive activations** (Sun et al. 2024, "Massive Activations in Large Language Models"): from layer
  ``massive_from`` on, a few dims of a few tokens (position 0 and the ``delimiters`` ids) hold values
  ``massive_ratio`` times the median entry, nearly equal in every layer, so that those rows dominate any global
  sum;
* **outlier feature dims** (Dettmers et al. 2022, LLM.int8()): ``outlier_dims`` dims carry a bias shared by all
  rows that grows with depth (tokens look alike along them);
* **context**: every layer mixes a causal mean over earlier positions, so only the embedding is a function of
  the token id alone;
* **engine noise** (:meth:`SyntheticTarget.engine`): two engines computing the same model differ by relative
  errors growing with depth (kernels, TP reduction order) and by their dtype's rounding.

Everything is seeded and computed with small low-rank maps, so a 61-layer, 7168-wide target costs a few
milliseconds per token. The generator is this project's own; nothing here is tuned to a detector (the
detectors' tests draw faults on top of it).

Shapes: every tensor is ``[T, H]`` float32 for ``T`` tokens (an engine view returns its own dtype).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class SynthConfig:
    """Knobs of a synthetic target (defaults: realistic, 32 layers x 512 wide).

    Attributes:
        num_layers / hidden_size / vocab_size: n, H, V.
        rank: width of the low-rank maps that build each layer's update.
        cos_adjacent: (low, high) median row cosine between adjacent layers; early and late layers sit
            near ``low``, middle layers near ``high``.
        norm_growth: row-norm growth factor per layer (ordinary rows).
        massive_dims / massive_ratio / massive_from: how many dims, how large (x the median |entry| of
            ordinary rows at that layer), first layer whose output carries them.
        delimiters: token ids that carry massive activations (besides position 0).
        outlier_dims / outlier_ratio: dims with a bias shared by all rows, reaching ``outlier_ratio`` x the
            typical |entry| at the last layer.
        embedding_scale: std of the embedding entries (real embeddings are much smaller than later layers).
        seed: everything derives from it.
    """

    num_layers: int = 32
    hidden_size: int = 512
    vocab_size: int = 4096
    rank: int = 32
    cos_adjacent: tuple[float, float] = (0.90, 0.99)
    norm_growth: float = 1.04
    massive_dims: int = 2
    massive_ratio: float = 2000.0
    massive_from: int = 2
    delimiters: tuple[int, ...] = (13, 29)
    outlier_dims: int = 4
    outlier_ratio: float = 8.0
    embedding_scale: float = 0.02
    seed: int = 0


class SyntheticTarget:
    """A deterministic synthetic deep target (see the module docstring).

    Args:
        config: :class:`SynthConfig` (or keyword overrides of its fields).

    The attributes ``n``, ``H``, ``vocab`` and the methods :meth:`states` / :meth:`rows` follow the interface
    of the test suite's HF runner, so the same writers build training data, served responses and dumps.
    """

    def __init__(self, config: Optional[SynthConfig] = None, **overrides):
        c = config or SynthConfig()
        if overrides:
            c = SynthConfig(**{**c.__dict__, **overrides})
        if c.num_layers < 4 or c.hidden_size < 16:
            raise ValueError("a synthetic target needs at least 4 layers and hidden size 16")
        self.config = c
        self.n, self.H, self.vocab = c.num_layers, c.hidden_size, c.vocab_size
        g = torch.Generator().manual_seed(c.seed)
        H, r = c.hidden_size, c.rank
        self.embed = torch.randn(c.vocab_size, H, generator=g) * c.embedding_scale
        s = 1 / math.sqrt(r)
        self.A = torch.randn(c.num_layers, H, r, generator=g) / math.sqrt(H)
        self.B = torch.randn(c.num_layers, r, H, generator=g) * s
        self.C = torch.randn(c.num_layers, H, r, generator=g) / math.sqrt(H)
        self.D = torch.randn(c.num_layers, r, H, generator=g) * s
        perm = torch.randperm(H, generator=g)
        self.massive_idx = perm[: c.massive_dims].clone()
        self.massive_sign = torch.where(torch.rand(c.massive_dims, generator=g) < 0.5, -1.0, 1.0)
        self.outlier_idx = perm[c.massive_dims: c.massive_dims + c.outlier_dims].clone()
        self.outlier_sign = torch.where(torch.rand(c.outlier_dims, generator=g) < 0.5, -1.0, 1.0)
        # final RMSNorm weight: lognormal around 1 with a few large entries, like trained norms
        self.norm_weight = torch.exp(0.3 * torch.randn(H, generator=g))
        self.norm_weight[perm[-3:]] *= 6.0
        lo, hi = c.cos_adjacent
        L = torch.arange(c.num_layers, dtype=torch.float64)
        cos = lo + (hi - lo) * torch.sin(math.pi * (L + 0.5) / c.num_layers)
        # |u| / |h| that gives cosine `cos` for an update orthogonal to h: cos = 1 / sqrt(1 + rho^2)
        self.rho = torch.sqrt(1 / cos ** 2 - 1).float()
        self._cache: dict = {}

    # ------------------------------------------------------------------------------------- forward
    def _massive_rows(self, ids: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(ids.shape[0], dtype=torch.bool)
        m[0] = True
        for d in self.config.delimiters:
            m |= ids == d
        return m

    @staticmethod
    def _rms(x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()

    def states(self, ids: Sequence[int], tp: int = 1) -> dict:
        """Every physical tensor for the token sequence ``ids`` (float32 ``[T, H]`` each).

        Keys: ``embedding``, ``out(L)`` for 0 <= L < n, ``final_norm``, ``mid(L)`` (the residual before the
        layer's token-wise update) and ``down_parts(L)`` (``tp`` tensors summing to ``out(L) - mid(L)``: the
        per-rank partial products a TP-``tp`` row-parallel layer would all-reduce).

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        key = (tuple(int(i) for i in ids), int(tp))
        if key in self._cache:
            return self._cache[key]
        c = self.config
        t = torch.tensor(key[0], dtype=torch.long)
        if t.numel() == 0 or int(t.min()) < 0 or int(t.max()) >= c.vocab_size:
            raise ValueError(f"token ids must lie in [0, {c.vocab_size}) and be non-empty")
        T = t.shape[0]
        g = torch.Generator().manual_seed(c.seed * 7919 + hash(key) % 100003)
        massive = self._massive_rows(t)
        h = self.embed[t].clone()
        res: dict = {"embedding": h.clone()}
        counts = torch.arange(1, T + 1, dtype=torch.float32)[:, None]
        M = None
        for L in range(c.num_layers):
            x = h / self._rms(h)
            local = torch.tanh(x @ self.A[L]) @ self.B[L]
            ctx = torch.cumsum(torch.tanh(x @ self.C[L]) @ self.D[L], 0) / counts
            u = local + ctx
            u = u - (u * h).sum(-1, keepdim=True) / h.pow(2).sum(-1, keepdim=True).clamp_min(1e-12) * h
            u = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-12)
            hm = h.clone()
            if M is not None:                 # the update of a row does not scale with its massive entries
                hm[massive.nonzero().flatten()[:, None], self.massive_idx[None, :]] = 0
            hn = hm.norm(dim=-1, keepdim=True)
            grow = c.norm_growth if L else 4.0  # the first layer lifts the small embedding
            mid = hm * grow + self.rho[L] * hn * grow * 0.5 * u + (h - hm)
            upd = self.rho[L] * hn * grow * 0.5 * u
            if c.outlier_dims:
                typical = h.abs().median()
                bias = torch.zeros(c.hidden_size)
                bias[self.outlier_idx] = self.outlier_sign * typical * c.outlier_ratio * (L + 1) / c.num_layers * 0.1
                upd = upd + bias
            new = mid + upd
            if L >= c.massive_from and c.massive_dims and bool(massive.any()):
                if M is None:
                    M = float(new[~massive].abs().median()) * c.massive_ratio if bool((~massive).any()) \
                        else float(new.abs().median()) * c.massive_ratio
                fade = 0.25 if L >= c.num_layers - 1 else 1.0
                val = self.massive_sign * M * fade * (1 + 1e-3 * (L - c.massive_from))
                rows = torch.nonzero(massive).flatten()
                for k, d in enumerate(self.massive_idx.tolist()):
                    upd[rows, d] += val[k] - new[rows, d]
                new = mid + upd
            parts = list(torch.randn(tp, T, c.hidden_size, generator=g) * upd.abs().mean()) if tp > 1 else []
            if tp > 1:
                corr = (upd - sum(parts)) / tp
                parts = [p + corr for p in parts]
            else:
                parts = [upd]
            res[f"mid({L})"] = mid
            res[f"down_parts({L})"] = parts
            res[f"out({L})"] = new
            h = new
        res["final_norm"] = h / self._rms(h) * self.norm_weight
        self._cache[key] = res
        return res

    def rows(self, ids: Sequence[int], tensors: Sequence[str], tp: int = 1) -> torch.Tensor:
        """``torch.cat([states[t] for t in tensors], -1)``: one row per token, ``len(tensors) * H`` wide."""
        st = self.states(ids, tp)
        return torch.cat([st[t] for t in tensors], dim=-1)

    def engine(self, name: str, *, noise: float = 1e-2, dtype: torch.dtype = torch.bfloat16) -> "EngineView":
        """A view of this target as computed by one engine: same model, its own errors.

        Args:
            name: the engine's name (its errors are seeded by it: two names = two engines).
            noise: relative error of the last layer's output (rms over a row; it grows as sqrt(depth) from 0);
                0 gives exact values (before ``dtype`` rounding).
            dtype: the engine's dtype (values are rounded to it and returned in it).
        """
        return EngineView(self, name, noise, dtype)

    # ------------------------------------------------------------------------------------- facts
    def adjacent_cosines(self, ids: Sequence[int]) -> list[float]:
        """Median row cosine of out(L) vs out(L+1) for L = 0 .. n-2 on ``ids`` (ordinary rows only)."""
        st = self.states(ids)
        keep = ~self._massive_rows(torch.tensor(list(ids)))
        out = []
        for L in range(self.n - 1):
            a, b = st[f"out({L})"][keep], st[f"out({L + 1})"][keep]
            out.append(float(torch.nn.functional.cosine_similarity(a, b, dim=-1).median()))
        return out


@dataclass
class EngineView:
    """:meth:`SyntheticTarget.engine`: the target's tensors with this engine's errors and dtype."""

    target: SyntheticTarget
    name: str
    noise: float
    dtype: torch.dtype
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def n(self) -> int:
        return self.target.n

    @property
    def H(self) -> int:
        return self.target.H

    @property
    def vocab(self) -> int:
        return self.target.vocab

    def states(self, ids: Sequence[int], tp: int = 1) -> dict:
        """:meth:`SyntheticTarget.states` with this engine's relative errors (growing as sqrt(depth), half
        proportional to each entry, half to the row's rms) and dtype rounding."""
        key = (tuple(int(i) for i in ids), int(tp))
        if key in self._cache:
            return self._cache[key]
        exact = self.target.states(ids, tp)
        seed = sum(ord(ch) * 131 ** k for k, ch in enumerate(self.name)) % (2 ** 31)
        g = torch.Generator().manual_seed(seed + hash(key) % 100003)
        n = self.target.n
        out: dict = {}

        def noisy(x: torch.Tensor, depth: float) -> torch.Tensor:
            if self.noise <= 0:
                return x.to(self.dtype)
            s = self.noise * math.sqrt(max(depth, 0.0) / n)
            rms = SyntheticTarget._rms(x)
            z1 = torch.randn(x.shape, generator=g)
            z2 = torch.randn(x.shape, generator=g)
            return (x + s * (0.7 * x.abs() * z1 + 0.7 * rms * z2)).to(self.dtype)

        for k, v in exact.items():
            if k.startswith("out(") or k.startswith("mid("):
                L = int(k[4:-1])
                out[k] = noisy(v, L + 1)
            elif k.startswith("down_parts("):
                L = int(k[11:-1])
                out[k] = [noisy(p, L + 1) for p in v]
            elif k == "final_norm":
                out[k] = noisy(v, n)
            else:
                out[k] = v.to(self.dtype)
        self._cache[key] = out
        return out

    def rows(self, ids: Sequence[int], tensors: Sequence[str], tp: int = 1) -> torch.Tensor:
        st = self.states(ids, tp)
        return torch.cat([st[t] for t in tensors], dim=-1)


def random_sequences(target: SyntheticTarget, count: int, *, prompt: tuple[int, int] = (12, 40),
                     continuation: int = 24, seed: int = 0, bos: int = 1) -> list[tuple[list[int], list[int]]]:
    """``count`` (prompt ids, continuation ids) pairs: each prompt starts with ``bos`` and holds some of the
    target's delimiter ids, like text with punctuation; lengths drawn from ``prompt``."""
    g = torch.Generator().manual_seed(seed)
    V = target.vocab
    dl = list(target.config.delimiters)
    out = []
    for _ in range(count):
        P = int(torch.randint(prompt[0], prompt[1] + 1, (1,), generator=g))
        toks = torch.randint(100, V, (P - 1 + continuation,), generator=g)
        # a delimiter every ~9 tokens
        for k in range(8, toks.shape[0], 9):
            if dl:
                toks[k] = dl[k % len(dl)]
        ids = [bos] + toks.tolist()
        out.append((ids[:P], ids[P:]))
    return out
