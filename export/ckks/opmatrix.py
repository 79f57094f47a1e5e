"""Sparse matrices of linear ops, built from their weights instead of by applying them to a basis.

Building an op's matrix by running it on every basis vector costs a float64 convolution of ``size``
images; from the weights it is index arithmetic over the non-zero taps only (a 1x1 convolution of 96
channels on 7x7 tokens: 150k entries, milliseconds).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

__all__ = ["conv_matrix"]


def conv_matrix(weight: np.ndarray, in_shape: tuple[int, ...], out_shape: tuple[int, ...], strides: list[int],
                dilations: list[int], begin_pads: list[int], groups: int) -> sp.csr_matrix:
    """(size_in, size_out) matrix of a zero-padded N-d convolution (bias excluded), batch axis of 1.

    Output ``(co, p)`` reads input ``(g * C_in/groups + ci, p * stride - pad + k * dilation)`` with weight
    ``w[co, ci, k]`` wherever that position lies inside the input.
    """
    c_out, c_in_group, *kernel = weight.shape
    spatial_in, spatial_out = tuple(in_shape[2:]), tuple(out_shape[2:])
    nd = len(kernel)
    positions = np.indices(spatial_out).reshape(nd, -1)  # (nd, P)
    taps = np.indices(kernel).reshape(nd, -1)  # (nd, K)
    stride = np.asarray(strides).reshape(nd, 1, 1)
    dilation = np.asarray(dilations).reshape(nd, 1, 1)
    pad = np.asarray(begin_pads).reshape(nd, 1, 1)
    source = positions[:, :, None] * stride - pad + taps[:, None, :] * dilation  # (nd, P, K)
    inside = np.all((source >= 0) & (source < np.asarray(spatial_in).reshape(nd, 1, 1)), axis=0)  # (P, K)
    p_idx, k_idx = np.nonzero(inside)
    flat_in = np.ravel_multi_index(tuple(source[:, p_idx, k_idx]), spatial_in)  # per valid (p, k)
    per_group = c_out // groups
    co = np.arange(c_out)[:, None, None]  # (Co, 1, 1)
    ci_local = np.arange(c_in_group)[None, :, None]  # (1, Cig, 1)
    ci = (co // per_group) * c_in_group + ci_local  # (Co, Cig, 1)
    w = weight.reshape(c_out, c_in_group, -1)[:, :, k_idx]  # (Co, Cig, V)
    size_in_sp, size_out_sp = int(np.prod(spatial_in)), int(np.prod(spatial_out))
    rows = ci * size_in_sp + flat_in[None, None, :]
    cols = co * size_out_sp + p_idx[None, None, :]
    rows, cols, w = (np.broadcast_to(a, w.shape).reshape(-1) for a in (rows, cols, w))
    keep = w != 0
    size_in = int(np.prod(in_shape))
    size_out = int(np.prod(out_shape))
    return sp.csr_matrix((w[keep], (rows[keep], cols[keep])), shape=(size_in, size_out))
