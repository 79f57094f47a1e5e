"""The cost-based planner: models written as plain torch code compile to small plans that compute exactly.

Correctness is checked without encryption: ``run_plain`` executes the compiled steps (layouts, diagonals,
rotations, reductions) on plaintext slot vectors, so a wrong diagonal or rotation shows up as a wrong logit.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn.functional as F
from graph_gen import shift_conv, user_models

import polyfhe
from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MulNode
from polyfhe.exporters.ckks.counters import naf_weight
from polyfhe.exporters.ckks.opmatrix import conv_matrix
from polyfhe.exporters.ckks.plan import plan_single
from polyfhe.program.ckks_program import CKKSProgram
from polyfhe.program.manifest import ProgramManifest
from polyfhe.program.params import CKKSParams
from polyfhe.program.slot_layout import pack_single, unpack_single
from polyfhe.runtime.execute import NumpyOps, execute


def _images(n: int, seed: int = 0) -> np.ndarray:
    """Fashion-MNIST when installed (realistic statistics), else smooth random images."""
    from polyfhe.data.sources import load_dataset

    try:
        return load_dataset("fashion-mnist").x_train[:n].astype(np.float64)
    except (FileNotFoundError, ValueError):
        rng = np.random.default_rng(seed)
        return np.clip(rng.random((n, 1, 28, 28)), 0, 1)


@pytest.fixture(scope="module")
def user_monet():
    """The issue's user-written MONet-BN with BatchNorm statistics from real images (weights untrained)."""
    torch.manual_seed(0)
    model = user_models().UserMONetBN()
    x = torch.tensor(_images(512), dtype=torch.float32)
    model.train()
    with torch.no_grad():  # running statistics as after training: the folded maps and ranges are realistic
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.momentum = None
        model(x)
    model.eval()
    calibration = x[:256].numpy()
    program = polyfhe.export(model, target="ckks", calibration=calibration)
    return model, program


def test_user_monet_compiles_to_a_small_exact_plan(user_monet):
    model, program = user_monet
    info = program.manifest.info
    assert info["plaintext_diagonals"] <= 4000, info["plaintext_diagonals"]  # 50,426 with the merge-all planner
    assert program.manifest.depth == info["analyzer"]["levels"]  # the cost model spends no extra level here
    assert program.manifest.depth <= program.params.levels
    assert info["fallbacks"] == []  # every rotation step has a key of its own, layouts as planned
    assert info["planned"]["key_switches"] == info["planned"]["rotations"] + info["products"]
    x = _images(520)[512:520]
    with torch.no_grad():
        expected = model.double()(torch.tensor(x)).numpy()
    model.float()
    got = program.run_plain(x)
    assert np.abs(got - expected).max() <= 1e-6 * max(1.0, np.abs(expected).max())


# ------------------------------------------------------------------------------------------------------------
# one map at a time: the planner's diagonals against the matrix product
# ------------------------------------------------------------------------------------------------------------
def _channel_map(c_in: int, c_out: int, hw: int, shifts: bool, rng) -> sp.csr_matrix:
    """A 1x1 channel mixing followed (optionally) by a per-quarter one-pixel shift, as (out, in) matrix."""
    w = rng.normal(size=(c_out, c_in, 1, 1))
    mix = conv_matrix(w, (1, c_in, hw, hw), (1, c_out, hw, hw), [1, 1], [1, 1], [0, 0], 1)
    if not shifts:
        return mix.T.tocsr()
    kernel = shift_conv(c_out).weight.detach().numpy()
    shift = conv_matrix(kernel, (1, c_out, hw, hw), (1, c_out, hw, hw), [1, 1], [1, 1], [1, 1], c_out)
    return (mix @ shift).T.tocsr()


def _run_circuit(circuit: Circuit, slots: int, x: np.ndarray) -> np.ndarray:
    plan = plan_single(circuit, slots)
    params = CKKSParams(2 * slots, (50,) + (30,) * circuit.depth + (50,), 30, "none")
    manifest = ProgramManifest(
        layout="single", params=params, input_shape=circuit.input_shape, input_size=circuit.input_size,
        output_size=circuit.output_size, output=circuit.output, steps=tuple(plan.steps),
        galois_steps=tuple(plan.galois_steps), input_range=(0.0, 1.0), info=dict(plan.stats),
        input_slots=plan.input_slots, output_slots=plan.output_slots,
        samples_per_ciphertext=int(plan.stats["samples_per_ciphertext"]))
    program = CKKSProgram.create(manifest, plan.arrays)
    vec = execute(program.manifest, program.arrays, NumpyOps(slots), pack_single(manifest, x), threads=1)
    return unpack_single(manifest, vec, len(x))


@pytest.mark.parametrize("c_in,c_out,shifts", [(8, 24, True), (24, 8, True), (16, 16, False), (3, 12, False)])
def test_single_map_plans_match_numpy(c_in, c_out, shifts):
    """Padded channel-major layouts, replicated inputs and the hybrid period: one map, then a square."""
    rng = np.random.default_rng(c_in * 100 + c_out)
    hw = 7  # 49 tokens per channel, padded to 64 slots
    a = _channel_map(c_in, c_out, hw, shifts, rng)
    b = _channel_map(c_out, c_out, hw, False, rng)
    n_in, n_out = c_in * hw * hw, c_out * hw * hw
    bias = rng.normal(size=n_out)
    circuit = Circuit(input_shape=(1, c_in, hw, hw), output_shape=(1, c_out, hw, hw))
    circuit.sizes = {0: n_in, 1: n_out, 2: n_out, 3: n_out}
    circuit.shapes = {0: (1, c_in, hw, hw), 1: (1, c_out, hw, hw), 2: (1, c_out, hw, hw), 3: (1, c_out, hw, hw)}
    circuit.nodes = [LinearNode(1, [0], [a], bias, n_out, "a"), MulNode(2, 1, 1, n_out, "square"),
                     LinearNode(3, [2, 0], [b, a], None, n_out, "b")]
    circuit.output = 3
    x = rng.random((2, n_in))
    expected = circuit.evaluate(x)
    h = x @ a.T.toarray() + bias
    assert np.allclose(expected, (h * h) @ b.T.toarray() + x @ a.T.toarray())  # the reference itself
    got = _run_circuit(circuit, 4096, x)
    assert np.allclose(got, expected, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------------------------
# pieces of the cost model and the compiler's weight math
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nd,c_in,c_out,groups,k,stride,dilation,pad,size", [
    (2, 4, 6, 1, 3, 1, 1, 1, 7), (2, 6, 6, 6, 3, 1, 1, 1, 7), (2, 1, 8, 1, 4, 4, 1, 0, 12),
    (2, 4, 8, 2, 3, 2, 2, 2, 9), (1, 2, 3, 1, 5, 2, 1, 2, 11), (3, 2, 2, 1, 2, 1, 1, 0, 4)])
def test_conv_matrix_matches_torch(nd, c_in, c_out, groups, k, stride, dilation, pad, size):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(c_out, c_in // groups, *[k] * nd))
    x = rng.normal(size=(1, c_in, *[size] * nd))
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    out = conv(torch.tensor(x), torch.tensor(w), stride=stride, dilation=dilation, padding=pad, groups=groups).numpy()
    m = conv_matrix(w, x.shape, out.shape, [stride] * nd, [dilation] * nd, [pad] * nd, groups)
    assert np.allclose((m.T @ x.reshape(-1)).reshape(out.shape), out, atol=1e-12)


@pytest.mark.parametrize("step,weight", [(0, 0), (1, 1), (3, 2), (7, 2), (11, 3), (57, 3), (64, 1), (192, 2)])
def test_naf_weight_counts_composed_key_switches(step, weight):
    assert naf_weight(step) == weight



def test_later_readers_of_the_input_are_costed_in_its_real_packing():
    """The client packs the input once, for its first consumer. cpolynext_fhe_bn's stem (7x7, stride 4) feeds
    a product and the residual stream; costed as if each later reader of the input got a packing of its own,
    the stem was merged again into four more maps (1,024 diagonals each) instead of read from a checkpoint."""
    torch.manual_seed(0)
    model = polyfhe.create_model("cpolynext_fhe_bn", num_classes=10, img_size=28, in_chans=1)
    x = _images(256)
    model.train()
    with torch.no_grad():  # BatchNorm statistics from real images, as after training
        for start in range(0, 256, 64):
            model(torch.tensor(x[start:start + 64], dtype=torch.float32))
    model.eval()
    program = polyfhe.export(model, target="ckks", calibration=x, spend_levels=False)
    readers = sum(1 for s in program.manifest.steps if s.op == "linear" and 0 in s.inputs)
    diagonals = program.manifest.info["plaintext_diagonals"]
    assert readers == 3 and diagonals <= 13_100, (readers, diagonals)  # 7 readers, 14,930 diagonals before
    with torch.no_grad():
        expected = model.double()(torch.tensor(x[:2])).numpy()
    model.float()
    assert np.abs(program.run_plain(x[:2]) - expected).max() <= 1e-6 * max(1.0, np.abs(expected).max())


def test_maps_reading_one_register_share_its_baby_rotations():
    """Eight maps read the input with the same 16 offsets. Planned one by one, each takes baby 4 x giant 4: the
    3 baby rotations are shared but every map adds 3 giant ones (27 rotations). Planned knowing the babies are
    shared, the maps take wide babies and at most one giant step each (at most 16 rotations)."""
    from polyfhe.exporters.ckks.counters import plan_counters
    from polyfhe.program.params import choose_params

    rng = np.random.default_rng(3)
    n, maps, slots = 1024, 8, 4096
    offsets = np.arange(16) * 64
    circuit = Circuit(input_shape=(n,), output_shape=(n,))
    circuit.sizes, circuit.shapes = {0: n}, {0: (n,)}
    for j in range(maps):
        rows = np.repeat(np.arange(n), len(offsets))
        cols = (rows + np.tile(offsets, n)) % n
        matrix = sp.csr_matrix((rng.normal(size=len(rows)), (rows, cols)), shape=(n, n))
        circuit.nodes.append(LinearNode(j + 1, [0], [matrix], None, n, f"map {j}"))
        circuit.sizes[j + 1], circuit.shapes[j + 1] = n, (n,)
    circuit.nodes.append(LinearNode(maps + 1, list(range(1, maps + 1)), [sp.identity(n, format="csr")] * maps,
                                    None, n, "sum"))
    circuit.sizes[maps + 1], circuit.shapes[maps + 1] = n, (n,)
    circuit.output = maps + 1
    plan = plan_single(circuit, slots, samples_per_ciphertext=1)
    params = choose_params(circuit.depth, 1, 1.0, poly_modulus_degree=2 * slots)
    counts = plan_counters(plan.steps, plan.arrays, plan.galois_steps, params, "single", slots)
    first = [s for s in plan.steps if s.op == "linear"][:maps]
    babies = {int(k) % int(s.linear.baby) for s in first for t in s.linear.terms for k in plan.arrays[t.diagonals.ks]}
    giants = {(i, int(k) // int(s.linear.baby)) for i, s in enumerate(first) for t in s.linear.terms
              for k in plan.arrays[t.diagonals.ks]}
    rotations = len(babies - {0}) + sum(1 for _, g in giants if g)
    assert rotations <= 16, (len(babies), sorted(giants))
    assert counts["rotations"] <= rotations + 2 * maps  # the summing map and the hybrid reductions add a few
    x = rng.normal(size=(2, n))
    got = _run_circuit(circuit, slots, x)
    assert np.allclose(got, circuit.evaluate(x), rtol=1e-9, atol=1e-9)
