"""Random polynomial CNNs (``graph_gen.py``) through the public CKKS API, checked against their ONNX in float64.

Each seed is a small torch model written the way users write them (convs, BN, shifts, residuals, products).
``program.run_plain`` executes the compiled steps on plaintext slot vectors, so it checks the slot layouts,
diagonals and rotations exactly; the reference is the same folded ONNX file, evaluated in float64 by onnx's
reference evaluator, so the two differ by rounding (about 1e-15), not by float32 noise.
"""

from __future__ import annotations

import numpy as np
import pytest
from graph_gen import ALL_KINDS, MAX_PRODUCTS, calibration_inputs, onnx_reference, random_model, torch_forward

import polyfhe
from polyfhe.engines.lattigo.format import lower_program, run_container_plain
from polyfhe.program.slot_layout import pack_single, unpack_single

# Chosen from seeds 0-699 (all compile and match, with one and with several samples per ciphertext, except 455,
# whose output is constant: three shifts empty its 2x2 image, and the compiler refuses the zero map) so that
# together they draw every stem, block, branch, pooling and input shape of the generator, and 0 to MAX_PRODUCTS
# products; test_seeds_cover_the_generator checks this.
SEEDS = [37, 142, 209, 288, 293, 330, 346, 419, 575, 585, 616, 689]
PACKED_SEEDS = [142, 293, 330, 575, 616]  # a subset, also compiled with several samples per ciphertext
ENCRYPTED_SEED = 346  # one product, N=8192: a fast round trip

TOLERANCE = 1e-6  # relative to the largest output; a wrong diagonal, rotation or slot map errs by O(1)


def _test_inputs(graph, n: int) -> np.ndarray:
    return calibration_inputs(graph, n=n, seed=7)  # not the calibration samples


def _reference(graph, tmp_path, x: np.ndarray) -> tuple[np.ndarray, polyfhe.AnalysisReport]:
    """The folded ONNX export's outputs in float64 and its analysis; the export itself is checked against torch."""
    path = polyfhe.export(graph.model, target="onnx", path=tmp_path / f"seed{graph.seed}.onnx",
                          input_shape=graph.input_shape)
    want = onnx_reference(path, x)
    torch_out = torch_forward(graph.model, x)  # float64 torch, float32 weights in the ONNX file: ~1e-7 apart
    assert np.max(np.abs(want - torch_out)) <= 1e-5 * np.abs(torch_out).max(), "ONNX reference != torch model"
    return want, polyfhe.analyze(path)


def _assert_close(got: np.ndarray, want: np.ndarray, graph) -> None:
    assert got.shape == want.shape, f"{graph.description}: output shape {got.shape} != {want.shape}"
    scale = float(np.abs(want).max())
    assert scale > 1e-3, f"{graph.description}: degenerate outputs; pick another seed"
    err = float(np.max(np.abs(got - want)))
    worst = np.unravel_index(np.argmax(np.abs(got - want)), got.shape)
    assert err <= TOLERANCE * scale, (f"{graph.description}: max abs error {err:.3e} (scale {scale:.3g}) at "
                                      f"sample/output {worst}: got {got[worst]:.6g}, want {want[worst]:.6g}")


def _check_manifest(prog, graph, report) -> None:
    m = prog.manifest
    assert 1 <= m.depth <= m.params.levels, f"depth {m.depth} over the ring's {m.params.levels} levels"
    assert m.depth <= report.levels, f"compiled depth {m.depth} > the analyzer's {report.levels} levels"
    assert m.depth >= graph.products + 1  # every product and the head's affine map consume a level
    assert report.polynomial and report.mult_depth == graph.products
    assert report.degree == 2 ** graph.products
    diagonals = m.info["plaintext_diagonals"]
    assert isinstance(diagonals, int) and not isinstance(diagonals, bool) and diagonals > 0


def _drifting_primes(params) -> list[int]:
    """Primes up to a few percent off their nominal size, alternately above and below: Lattigo's real ones are
    parts in 10^4 off, so scales drift apart far faster here and a missed add correction errs by percents."""
    return [round((1 << bits) * (1 + (-1) ** i * 0.004 * (i % 5))) for i, bits in enumerate(params.coeff_mod_bits[:-1])]


def _lattigo_plain(prog, x: np.ndarray) -> np.ndarray:
    """The program as lowered for Lattigo's evaluator, run with the evaluator's semantics (scale bookkeeping
    included) on plain slots."""
    data = lower_program(prog, _drifting_primes(prog.params)).data
    lanes, flat = prog.manifest.samples_per_ciphertext, x.reshape(len(x), -1)
    return np.concatenate([unpack_single(prog.manifest, run_container_plain(data, pack_single(prog.manifest, chunk)),
                                         len(chunk)) for chunk in (flat[i:i + lanes] for i in range(0, len(x), lanes))])


def _seed_id(seed: int) -> str:
    return f"seed{seed}"


@pytest.mark.parametrize("seed", SEEDS, ids=_seed_id)
def test_random_graph_single_layout_matches_onnx(seed, tmp_path):
    graph = random_model(seed)
    prog = polyfhe.export(graph.model, target="ckks", layout="single", calibration=calibration_inputs(graph),
                          samples_per_ciphertext=1)
    x = _test_inputs(graph, 6)
    want, report = _reference(graph, tmp_path, x)
    assert prog.manifest.samples_per_ciphertext == 1
    _assert_close(prog.run_plain(x), want, graph)
    _assert_close(_lattigo_plain(prog, x), want, graph)
    _check_manifest(prog, graph, report)


@pytest.mark.parametrize("seed", PACKED_SEEDS, ids=_seed_id)
def test_random_graph_several_samples_per_ciphertext(seed, tmp_path):
    graph = random_model(seed)
    prog = polyfhe.export(graph.model, target="ckks", layout="single", calibration=calibration_inputs(graph),
                          samples_per_ciphertext=None)
    m = prog.manifest
    lanes = m.samples_per_ciphertext
    # The widest tensor here has at most 12 x 8 x 8 = 768 values and the ring at least 4096 slots: room for more.
    assert lanes > 1 and lanes & (lanes - 1) == 0 and lanes <= m.params.slots
    x = _test_inputs(graph, 2 * lanes + 3)  # two full ciphertexts and a partly filled one
    want, report = _reference(graph, tmp_path, x)
    _assert_close(prog.run_plain(x), want, graph)
    _assert_close(_lattigo_plain(prog, x), want, graph)
    _check_manifest(prog, graph, report)
    # Each sample's lane is independent of its neighbours: a sample alone gives the same output as in a crowd.
    np.testing.assert_allclose(prog.run_plain(x[lanes + 1:lanes + 2]), prog.run_plain(x)[lanes + 1:lanes + 2],
                               rtol=0, atol=1e-12 * float(np.abs(want).max()))


@pytest.mark.fhe
@pytest.mark.parametrize("backend", ["seal", "lattigo"])
def test_random_graph_encrypted_round_trip(backend):
    graph = random_model(ENCRYPTED_SEED)
    prog = polyfhe.export(graph.model, target="ckks", layout="single", calibration=calibration_inputs(graph),
                          backend=backend)
    lanes = prog.manifest.samples_per_ciphertext
    x = _test_inputs(graph, min(lanes, 3))
    client = prog.client()
    server = prog.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x)))
    plain = prog.run_plain(x)
    assert got.shape == plain.shape == (len(x), prog.manifest.output_size)
    assert float(np.abs(plain).max()) > 1e-2
    np.testing.assert_allclose(got, plain, rtol=0, atol=1e-3)
    np.testing.assert_allclose(got, torch_forward(graph.model, x), rtol=0, atol=1e-3)


def test_seeds_cover_the_generator():
    graphs = [random_model(s) for s in SEEDS]
    drawn = frozenset().union(*(g.kinds for g in graphs))
    assert drawn == ALL_KINDS, f"not drawn by any seed: {sorted(ALL_KINDS - drawn)}"
    assert {g.products for g in graphs} == set(range(MAX_PRODUCTS + 1))
    assert set(PACKED_SEEDS) <= set(SEEDS) and ENCRYPTED_SEED in SEEDS
    again = random_model(SEEDS[0])  # reproducible: same structure and weights from the same seed
    x = calibration_inputs(again)
    assert again.description == graphs[0].description
    np.testing.assert_array_equal(torch_forward(again.model, x), torch_forward(graphs[0].model, x))
