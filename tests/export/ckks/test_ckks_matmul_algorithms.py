"""Every single-layout MatMul algorithm against numpy, on random shapes (M, K, N from 1 to 64, several heads).

Each algorithm is forced on a circuit whose operands come from linear maps of the input (as in attention, where
they are composed) and, separately, straight from the input and a product (where they are maps of their own);
the expanded circuit must compute ``a @ b`` exactly (the gathers and sums are 0/1 maps), keep every register
within the slots, and the chosen algorithm must be recorded. Then the reassociation of linear attention, and
small programs encrypted on both engines.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from ckks_testlib import LinearAttention

from polyfhe.exporters.ckks.circuit import Circuit, LinearNode, MatMulNode, MulNode
from polyfhe.exporters.ckks.matmul import ALGORITHMS, expand_matmuls
from polyfhe.exporters.ckks.matmul.algorithms import tiles_for
from polyfhe.exporters.ckks.matmul.space import MatMulShape

RNG = np.random.default_rng(35)


def _random_shapes(count: int, seed: int) -> list[tuple[int, int, int, int]]:
    """(heads, M, K, N) with M, K, N drawn from 1..64 and 1-3 heads, kept under 12k products (test time)."""
    rng, found = np.random.default_rng(seed), []
    while len(found) < count:
        heads, m, k, n = int(rng.integers(1, 4)), *(int(d) for d in rng.integers(1, 65, size=3))
        if heads * m * k * n <= 12_000:
            found.append((heads, m, k, n))
    return found


SHAPES = [(1, 1, 1, 1), (2, 7, 4, 9)] + _random_shapes(2, 35)


def _circuit(heads: int, m: int, k: int, n: int, linear_operands: bool) -> Circuit:
    """``out = A(x) @ B(x)`` with A, B random linear maps of the input (or the input and its square)."""
    a_shape, b_shape, out_shape = (1, heads, m, k), (1, heads, k, n), (1, heads, m, n)
    size_a, size_b = int(np.prod(a_shape)), int(np.prod(b_shape))
    width = max(size_a, size_b)
    circuit = Circuit(input_shape=(width,), output_shape=out_shape)
    circuit.sizes[0], circuit.shapes[0] = width, (width,)
    if linear_operands:
        circuit.nodes += [LinearNode(1, [0], [sp.csr_matrix(RNG.normal(size=(size_a, width)))], None, size_a, "A"),
                          LinearNode(2, [0], [sp.csr_matrix(RNG.normal(size=(size_b, width)))], None, size_b, "B")]
    else:  # A: the input's first values (a 0/1 map); B: a product
        pick = sp.csr_matrix((np.ones(size_a), (np.arange(size_a), np.arange(size_a))), shape=(size_a, width))
        square = sp.csr_matrix((np.ones(size_b), (np.arange(size_b), np.arange(size_b))), shape=(size_b, width))
        circuit.nodes += [LinearNode(1, [0], [pick], None, size_a, "A"),
                          LinearNode(5, [0], [square], None, size_b, "x part"),
                          MulNode(2, 5, 5, size_b, "B = x part squared")]
        circuit.sizes[5], circuit.shapes[5] = size_b, b_shape
    circuit.sizes.update({1: size_a, 2: size_b, 3: int(np.prod(out_shape)), 4: int(np.prod(out_shape))})
    circuit.shapes.update({1: a_shape, 2: b_shape, 3: out_shape, 4: out_shape})
    circuit.nodes += [MatMulNode(3, 1, 2, a_shape, b_shape, out_shape, circuit.sizes[3], "MatMul"),
                      LinearNode(4, [3], [sp.identity(circuit.sizes[3], format="csr") * 0.5], None,
                                 circuit.sizes[3], "scale")]
    circuit.output = 4
    return circuit


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_each_algorithm_computes_the_matmul(algorithm):
    slots = 1024
    for heads, m, k, n in SHAPES:
        shape = MatMulShape((1, heads, m, k), (1, heads, k, n), (1, heads, m, n))
        if tiles_for(ALGORITHMS[algorithm], shape, slots) is None:
            continue  # e.g. replicate past one register, or an offset over an axis of size 1
        for linear_operands in (True, False):
            circuit = _circuit(heads, m, k, n, linear_operands)
            x = RNG.normal(size=(3, circuit.sizes[0]))
            expanded = expand_matmuls(circuit, slots, algorithm=algorithm)
            assert not any(isinstance(node, MatMulNode) for node in expanded.nodes)
            assert expanded.matmuls[0]["algorithm"] == algorithm
            assert max(s for r, s in expanded.sizes.items() if r not in circuit.sizes) <= slots
            np.testing.assert_allclose(expanded.evaluate(x), circuit.evaluate(x), rtol=1e-10, atol=1e-10,
                                       err_msg=f"{algorithm} on heads={heads} M={m} K={k} N={n}")


@pytest.mark.parametrize(("heads", "m", "k", "n"), [(2, 7, 4, 9), (1, 24, 8, 24), (3, 5, 16, 6)])
def test_the_cost_model_choice_is_recorded_and_exact(heads, m, k, n):
    circuit = _circuit(heads, m, k, n, linear_operands=True)
    expanded = expand_matmuls(circuit, 8192)
    record = expanded.matmuls[0]
    assert record["algorithm"] in ALGORITHMS and record["algorithm"] in record["candidates"]
    assert record["registers"] == record["products"] >= 1
    assert record["shape"] == f"1x{heads}x{m}x{n}x{k}"
    x = RNG.normal(size=(2, circuit.sizes[0]))
    np.testing.assert_allclose(expanded.evaluate(x), circuit.evaluate(x), rtol=1e-10, atol=1e-10)
    assert any(isinstance(node, MatMulNode) for node in circuit.nodes)  # the input circuit is left as it was


def _linear_attention(tokens: int, width: int, offset: float):
    import torch

    torch.manual_seed(0)
    return LinearAttention(tokens, width, offset).eval(), RNG.normal(size=(8, tokens, width))


@pytest.mark.parametrize("offset", [0.0, 0.3])
def test_linear_attention_is_reassociated_exactly(offset):
    """(D Q K^T + c) V with a per-query scale D and offset c becomes D Q (K^T V) + c 1^T V: T=24 tokens of
    width 8 take 2 x 8 x 24 x 8 products instead of 2 x 24 x 24 x 8."""
    import torch

    from polyfhe.exporters.ckks import to_onnx_model
    from polyfhe.exporters.ckks.lower import lower_onnx

    model, x = _linear_attention(24, 8, offset)
    proto, _ = to_onnx_model(model, x.shape[1:])
    circuit = lower_onnx(proto)
    expanded = expand_matmuls(circuit, 8192)
    records = expanded.matmuls
    assert records[0]["reassociated"] == "(Q K^T) V -> Q (K^T V)"
    assert (records[0]["products_before"], records[0]["products_after"]) == (2 * 24 * 24 * 8, 2 * 8 * 24 * 8)
    assert [r["shape"] for r in records[1:]] == ["1x8x8x24", "1x24x8x8"]
    np.testing.assert_allclose(expanded.evaluate(x), circuit.evaluate(x), rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # torch in float64 against the graph's float32 constants
        want = model.double()(torch.tensor(x)).numpy().reshape(len(x), -1)
    np.testing.assert_allclose(expanded.evaluate(x), want, rtol=1e-6, atol=1e-6)


def test_a_polynomial_kernel_is_not_reassociated():
    """(Q K^T)^2 V is not affine in the scores: no reassociation, and still exact."""
    from test_ckks_matmul import _attention, _torch

    from polyfhe.exporters.ckks import to_onnx_model
    from polyfhe.exporters.ckks.lower import lower_onnx

    model, x = _attention()
    proto, _ = to_onnx_model(model, x.shape[1:])
    expanded = expand_matmuls(lower_onnx(proto), 8192)
    assert not any("reassociated" in r for r in expanded.matmuls) and len(expanded.matmuls) == 2
    np.testing.assert_allclose(expanded.evaluate(x), _torch(model, x), rtol=1e-6, atol=1e-6)


def test_multi_register_attention_encrypted_on_seal(monkeypatch):
    """Linear attention on 24 tokens of width 16, reassociated and spread over several registers (forced to
    512 slots each): the encrypted output matches the plaintext program."""
    from polyfhe.exporters.ckks import export_ckks, matmul

    model, x = _linear_attention(24, 16, 0.2)
    monkeypatch.setattr(matmul, "register_slots", lambda circuit, slots: 512)
    prog = export_ckks(model, calibration=x, layout="single", input_shape=x.shape[1:])
    info = prog.manifest.info
    assert any(m.get("registers", 1) > 1 for m in info["matmuls"])
    client = prog.client()
    server = prog.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:1])))
    want = prog.run_plain(x[:1])
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())


def test_lattigo_refuses_a_matmul_over_several_registers(monkeypatch):
    """Lattigo decrypted such plans to wrong values (where SEAL is exact): it refuses them, naming what fits."""
    from polyfhe.exporters.ckks import CKKSExportError, export_ckks, matmul

    model, x = _linear_attention(24, 16, 0.2)
    monkeypatch.setattr(matmul, "register_slots", lambda circuit, slots: 512)
    with pytest.raises(CKKSExportError, match=r"engine 'lattigo' runs it in at most 1 \(it fits when batch x M x "
                                              r"N x K <= \d+\); use backend='seal'"):
        export_ckks(model, calibration=x, layout="single", input_shape=x.shape[1:], backend="lattigo")
