"""Taylor layer (TaylorNet, Zhao et al., ICLR 2023 submission): a degree-K Taylor polynomial with Tucker factors.

``y = b + sum_{k=1..K} T_k(x, ..., x)`` where ``T_k`` (out x n^k, the k-th derivative tensor divided by k!) is
Tucker-decomposed: ``T_k = G_k x_0 O_k x_1 U_k1 ... x_k U_kk`` with input factors ``U_kj`` (r x n), a core
``G_k`` (r x r^k, modes in row-major order) and an output factor ``O_k`` (out x r). Evaluated as
``O_k G_k (z_1 kron ... kron z_k)`` with ``z_j = U_kj x``. The Kronecker product is built from unsqueeze /
expand / reshape and elementwise products (a balanced tree, so order k costs ceil(log2 k) ct x ct depth) and the
core and output factor are plain linear maps: the exported graph is add/mul-only, never an Einsum between two
encrypted tensors. The expansion point is 0 (a shift x0 is absorbed by the bias and the lower orders).

Reducible variant (``reducible=True``, our reading of R-TaylorNet's "remove redundant hidden parameters"; the
paper's section text was not available to us, only its abstract): ``T_k(x, ..., x)`` only sees the symmetric
part of ``T_k``, so (i) one input factor ``U_k`` (r x n) is shared by all k modes, and (ii) the hidden
Kronecker features ``z_{i1} ... z_{ik}`` repeat every monomial k!/(multiplicities) times, so only the
``C(r+k-1, k)`` distinct monomials (i1 <= ... <= ik, gathered with constant indices) are kept and the core is
r x C(r+k-1, k). Parameters per order drop from ``out*r + k*r*n + r^(k+1)`` to ``out*r + r*n + r*C(r+k-1,k)``.

Initialisation (``init``):
- ``"taylor"`` (the paper's Taylor initialisation, as a public implementation of its Taylor layer does it):
  bias 0; the order-1 output factor ~ N(0, 1/r) and the higher-order output factors 0, so the layer starts as a
  linear map and the higher-order terms grow from zero; cores ~ N(0, 1/r^k); order-k input factors ~ N(0, s_k^2) with
  ``s_k = (prod_{i<k} 1/(n + 2i))^(1/(2k))`` so that a product of k projections of x ~ N(0, I_n) has unit
  variance (E|x|^(2k) = n (n+2) ... (n+2k-2)). That code writes the exponent as 2^-k, equal to 1/(2k)
  for k <= 2; for k >= 3 we follow the variance argument.
- ``"xavier"`` / ``"kaiming"``: the baselines of the paper's comparison: every factor matrix and core gets torch's
  ``xavier_uniform_`` / ``kaiming_uniform_`` (torch defaults), bias 0.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from polyfhe.models.configs import check_positive_ints

__all__ = ["TAYLOR_INITS", "TaylorLayer", "kron_features", "taylor_input_std", "taylor_layer_param_count"]

TAYLOR_INITS = ("taylor", "xavier", "kaiming")


def taylor_layer_param_count(in_features: int, out_features: int, order: int, rank: int,
                             reducible: bool = False) -> int:
    """Hand count of a :class:`TaylorLayer`'s parameters (bias + per order: output factor, input factors, core)."""
    total = out_features
    for k in range(1, order + 1):
        if reducible:
            total += out_features * rank + rank * in_features + rank * math.comb(rank + k - 1, k)
        else:
            total += out_features * rank + k * rank * in_features + rank * rank**k
    return total


def taylor_input_std(in_features: int, k: int) -> float:
    """Std of the order-k input factors under Taylor init: unit variance for a product of k projections."""
    log_var = -sum(math.log(in_features + 2 * i) for i in range(k)) / k
    return math.exp(0.5 * log_var)


def _kron2(a: Tensor, b: Tensor) -> Tensor:
    """Row-major Kronecker product of the last axes, (..., p) x (..., q) -> (..., p*q), with same-shape products."""
    p, q = a.shape[-1], b.shape[-1]
    lead = a.shape[:-1]
    a2 = a.unsqueeze(-1).expand(*lead, p, q).reshape(*lead, p * q)
    b2 = b.unsqueeze(-2).expand(*lead, p, q).reshape(*lead, p * q)
    return a2 * b2


def kron_features(zs: list[Tensor]) -> Tensor:
    """``z_1 kron ... kron z_k`` as a balanced tree (ct x ct depth ceil(log2 k), row-major index order)."""
    if len(zs) == 1:
        return zs[0]
    mid = (len(zs) + 1) // 2
    return _kron2(kron_features(zs[:mid]), kron_features(zs[mid:]))


def _product_tree(factors: list[Tensor]) -> Tensor:
    if len(factors) == 1:
        return factors[0]
    mid = (len(factors) + 1) // 2
    return _product_tree(factors[:mid]) * _product_tree(factors[mid:])


class TaylorLayer(nn.Module):
    """``b + sum_k T_k(x, ..., x)`` on (..., in_features) -> (..., out_features); degree ``order``."""

    def __init__(self, in_features: int, out_features: int, order: int, rank: int,
                 reducible: bool = False, init: str = "taylor") -> None:
        super().__init__()
        check_positive_ints("TaylorLayer", {"in_features": in_features, "out_features": out_features,
                                             "order": order, "rank": rank})
        if init not in TAYLOR_INITS:
            raise ValueError(f"TaylorLayer init must be one of {', '.join(map(repr, TAYLOR_INITS))}, got {init!r}")
        self.in_features, self.out_features = in_features, out_features
        self.order, self.rank, self.reducible, self.init = order, rank, bool(reducible), init
        self.bias = nn.Parameter(torch.zeros(out_features))
        modes = (lambda k: 1) if reducible else (lambda k: k)
        width = (lambda k: math.comb(rank + k - 1, k)) if reducible else (lambda k: rank**k)
        self.in_factors = nn.ParameterList(
            [nn.Parameter(torch.empty(modes(k), rank, in_features)) for k in range(1, order + 1)])
        self.cores = nn.ParameterList([nn.Parameter(torch.empty(rank, width(k))) for k in range(1, order + 1)])
        self.out_factors = nn.ParameterList(
            [nn.Parameter(torch.empty(out_features, rank)) for _ in range(1, order + 1)])
        for k in range(2, order + 1):  # constant indices of the distinct monomials i1 <= ... <= ik
            if reducible:
                combos = torch.tensor(list(itertools.combinations_with_replacement(range(rank), k)))
                self.register_buffer(f"monomials_{k}", combos.t().contiguous(), persistent=False)
        self.reset_parameters()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, order={self.order}, "
                f"rank={self.rank}, reducible={self.reducible}, init={self.init!r}")

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)
        for k, (u, g, o) in enumerate(zip(self.in_factors, self.cores, self.out_factors, strict=True), start=1):
            if self.init == "taylor":
                if k == 1:
                    nn.init.normal_(o, 0.0, self.rank**-0.5)
                else:
                    nn.init.zeros_(o)
                nn.init.normal_(u, 0.0, taylor_input_std(self.in_features, k))
                nn.init.normal_(g, 0.0, self.rank ** (-k / 2))
                continue
            fn = nn.init.xavier_uniform_ if self.init == "xavier" else nn.init.kaiming_uniform_
            for mode in u:
                fn(mode)
            fn(g)
            fn(o)

    def order_term(self, x: Tensor, k: int) -> Tensor:
        """``T_k(x, ..., x)``: project, form the degree-k hidden features, then core and output factor."""
        u, core, out = self.in_factors[k - 1], self.cores[k - 1], self.out_factors[k - 1]
        if self.reducible:
            z = F.linear(x, u[0])
            if k == 1:
                feats = z
            else:
                idx = getattr(self, f"monomials_{k}")
                feats = _product_tree([torch.index_select(z, -1, idx[j]) for j in range(k)])
        else:
            zs = F.linear(x, u.reshape(k * self.rank, self.in_features))
            feats = kron_features(list(zs.split(self.rank, dim=-1)))
        return F.linear(F.linear(feats, core), out)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.jit.is_tracing() and x.shape[-1] != self.in_features:
            raise ValueError(f"TaylorLayer expects (..., {self.in_features}) inputs, got {tuple(x.shape)}")
        y = self.order_term(x, 1) + self.bias
        for k in range(2, self.order + 1):
            y = y + self.order_term(x, k)
        return y

    @torch.no_grad()
    def derivative_tensors(self) -> list[Tensor]:
        """Dense coefficients ``[b, T_1 (out x n), T_2 (out x n x n), ...]`` (for inspection of small layers)."""
        result = [self.bias.detach().clone()]
        r = self.rank
        for k in range(1, self.order + 1):
            u, core, out = self.in_factors[k - 1], self.cores[k - 1], self.out_factors[k - 1]
            if self.reducible and k > 1:
                full = torch.zeros(r, r**k, dtype=core.dtype, device=core.device)
                idx = getattr(self, f"monomials_{k}")
                flat = torch.zeros(idx.shape[1], dtype=torch.long, device=core.device)
                for j in range(k):
                    flat = flat * r + idx[j]
                full[:, flat] = core
                core = full
            t = (out @ core).reshape(self.out_factors[k - 1].shape[0], *([r] * k))
            for j in range(k):  # contract mode j+1 with its input factor (rank -> in_features)
                factor = u[0] if self.reducible else u[j]
                t = torch.tensordot(t, factor, dims=([1], [0]))  # appends the new in_features axis last
            result.append(t)
        return result
