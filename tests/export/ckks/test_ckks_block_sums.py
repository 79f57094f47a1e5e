"""Block sums broadcast over their blocks (``plan.BlockSums``): a window sum, one diagonal and a spread.

``K^T V`` regathered for ``Q (K^T V)`` sums each row's token products and hands the total to every token of the
row: a map with ``2 * tokens - 1`` diagonals, or ``2 log2(block)`` rotations and one diagonal. The window sums a
whole block, so the input must be clean (zero in its block's empty slots): checked here with exact plaintext
runs, a register that is not clean, the manifest's validation, Lattigo's refusal, and an encrypted SEAL run.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from test_ckks_planner import _run_circuit

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MulNode
from polyfhe.exporters.ckks.plan import block_sums, plan_single
from polyfhe.program.errors import ProgramError
from polyfhe.program.steps import LinearAttrs

ROWS, COLS = 32, 24  # a register of 32 rows of 24 tokens, padded to blocks of 32 slots


def _regather(rows: int, cols: int, weights: np.ndarray | None = None) -> sp.csr_matrix:
    """out[r, t] = w[r] * sum_t' in[r, t']: every token of a row gets the row's total."""
    w = np.ones(rows) if weights is None else weights
    return sp.csr_matrix(sp.kron(sp.diags(w), np.ones((cols, cols))))


def _circuit(clean: bool) -> Circuit:
    """x -> two maps -> their product P -> regather(P) -> times a third map -> a weighted sum. ``clean=False``
    regathers the product of two regathers instead, whose block slots beyond the tokens are not zero."""
    rng = np.random.default_rng(7)
    n, size = 64, ROWS * COLS
    shape = (ROWS, COLS)
    circuit = Circuit(input_shape=(n,), output_shape=(ROWS,))
    circuit.sizes, circuit.shapes = {0: n}, {0: (n,)}

    def add(node, shape_of=shape):
        circuit.nodes.append(node)
        circuit.sizes[node.out], circuit.shapes[node.out] = node.size, shape_of

    for reg in (1, 2, 3):
        add(LinearNode(reg, [0], [sp.csr_matrix(rng.normal(size=(size, n)))], None, size, f"map {reg}"))
    add(MulNode(4, 1, 2, size, "P"))
    source = 4
    if not clean:
        add(LinearNode(5, [4], [_regather(ROWS, COLS)], None, size, "first regather"))
        add(MulNode(6, 5, 5, size, "regathered squared"))
        source = 6
    add(LinearNode(7, [source], [_regather(ROWS, COLS, rng.uniform(0.5, 1.5, ROWS))], None, size, "regather"))
    add(MulNode(8, 7, 3, size, "S times map 3"))
    add(LinearNode(9, [8], [sp.csr_matrix(sp.kron(sp.identity(ROWS), np.ones((1, COLS))))], None, ROWS, "sums"),
        (ROWS,))
    circuit.output = 9
    return circuit


def test_a_regather_map_is_a_block_sum():
    rows = np.repeat(np.arange(4) * 64, 48 * 48) + np.tile(np.repeat(np.arange(48), 48), 4)
    cols = np.repeat(np.arange(4) * 64, 48 * 48) + np.tile(np.tile(np.arange(48), 48), 4)
    layout = (np.arange(4)[:, None] * 64 + np.arange(48)).reshape(-1)
    sums = block_sums(rows, cols, np.ones(len(rows)), layout, 256)
    assert sums is not None and sums.block == 64 and sums.rotations == 12
    assert sums.pre == (1, 2, 4, 8, 16, 32) and sums.post == (255, 254, 252, 248, 240, 224)
    assert np.count_nonzero(sums.weights) == 4 and sums.weights[64] == 1.0
    varying = np.ones(len(rows))
    varying[5] = 2.0
    assert block_sums(rows, cols, varying, layout, 256) is None  # two weights in one block
    crowded = np.concatenate([layout, [60]])  # another element in a block: a window would add it in
    assert block_sums(rows, cols, np.ones(len(rows)), crowded, 256) is None
    assert block_sums(rows[1:], cols[1:], np.ones(len(rows) - 1), layout, 256) is None  # not every pair


@pytest.mark.parametrize("clean", [True, False])
def test_block_sum_plans_compute_exactly(clean):
    circuit = _circuit(clean)
    plan = plan_single(circuit, 4096, samples_per_ciphertext=1)
    windowed = [s.linear.label for s in plan.steps if s.op == "linear" and s.linear.pre_sums]
    # the first regather reads a clean product; a regather of a regather's square does not, and stays diagonals
    assert windowed == (["regather"] if clean else ["first regather"])
    plain = plan_single(circuit, 4096, samples_per_ciphertext=1, block_sum_maps=False)
    assert not any(s.op == "linear" and s.linear.pre_sums for s in plain.steps)
    diagonals = [sum(len(p.arrays[t.diagonals.ks]) for s in p.steps
                     if s.op == "linear" and s.linear.label == windowed[0] for t in s.linear.terms)
                 for p in (plan, plain)]
    assert diagonals[0] == 1 and diagonals[1] >= 2 * COLS - 1  # one diagonal instead of 2 * 24 - 1
    x = np.random.default_rng(1).normal(size=(2, 64))
    np.testing.assert_allclose(_run_circuit(circuit, 4096, x), circuit.evaluate(x), rtol=1e-9, atol=1e-9)


def test_the_manifest_refuses_bad_rotate_sums():
    base = {"terms": [], "bias": None, "period": 64, "baby": 1}
    assert LinearAttrs.from_dict({**base, "pre_sums": [1, 2], "post_sums": [63, 62]}).post_sums == (63, 62)
    with pytest.raises(ProgramError, match="positive rotation steps"):
        LinearAttrs.from_dict({**base, "pre_sums": [-1]})
    with pytest.raises(ProgramError, match="at most 24"):
        LinearAttrs.from_dict({**base, "post_sums": list(range(1, 40))})


def test_block_sums_run_encrypted_on_seal(monkeypatch):
    """Linear attention on 24 tokens over several 512-slot registers: its ``K^T V`` regathers are block sums,
    and the encrypted output matches the plaintext program."""
    from test_ckks_matmul_algorithms import _linear_attention

    from polyfhe.engines.lattigo.format import lower_program
    from polyfhe.exporters.ckks import export_ckks, matmul

    model, x = _linear_attention(24, 16, 0.2)
    monkeypatch.setattr(matmul, "register_slots", lambda circuit, slots: 512)
    prog = export_ckks(model, calibration=x, layout="single", input_shape=x.shape[1:])
    assert any(s.op == "linear" and s.linear.post_sums for s in prog.manifest.steps)
    client = prog.client()
    server = prog.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:1])))
    want = prog.run_plain(x[:1])
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    with pytest.raises(ValueError, match="rotate-and-add"):  # a Lattigo graph has no such step
        lower_program(prog)
