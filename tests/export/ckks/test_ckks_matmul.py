"""ct x ct MatMul in the single layout: the broadcast (``replicate``) algorithm and the compiler around it
(export/ckks/matmul/); every algorithm against numpy is in test_ckks_matmul_algorithms.py."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper
from torch import nn

from polyfhe.exporters.ckks import export_ckks, to_onnx_model
from polyfhe.exporters.ckks.affine import LoweringError
from polyfhe.exporters.ckks.circuit import LinearNode, MatMulNode, MulNode
from polyfhe.exporters.ckks.lower import lower_onnx
from polyfhe.exporters.ckks.matmul import expand_matmuls, matmul_index_maps
from polyfhe.models.polynext import ARCHS, PolyNeXtArch, StageConfig, build_polynext


class Attention(nn.Module):
    """Polynomial multi-head attention on (tokens, channels): (s QK^T + 1)^2 / T, then AV and a projection."""

    def __init__(self, tokens: int = 8, channels: int = 16, heads: int = 2, head_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        width = heads * head_dim
        self.q = nn.Linear(channels, width, bias=False)
        self.k = nn.Linear(channels, width, bias=False)
        self.v = nn.Linear(channels, width)
        self.out = nn.Linear(width, channels)

    def _split(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)  # (b, heads, tokens, head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(self.v(x))
        a = (q @ k.transpose(-2, -1)) * 0.1 + 1.0
        a = a * a / n
        return self.out((a @ v).transpose(1, 2).reshape(b, n, -1))


def _attention(tokens=8, channels=16, heads=2, head_dim=8):
    torch.manual_seed(0)
    model = Attention(tokens, channels, heads, head_dim).eval()
    x = np.random.default_rng(0).normal(size=(64, tokens, channels))
    return model, x


def _torch(model, x):
    with torch.no_grad():
        return model.double()(torch.tensor(x)).numpy().reshape(len(x), -1)


def test_index_maps_compute_a_broadcast_matmul():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 1, 3, 4)), rng.normal(size=(5, 4, 6))
    want = np.matmul(a, b)
    space, ia, ib, io = matmul_index_maps(a.shape, b.shape, want.shape)
    assert space == (6, 2, 5, 4, 3) and len(ia) == want.size * 4
    got = np.zeros(want.size)
    np.add.at(got, io, a.reshape(-1)[ia] * b.reshape(-1)[ib])
    np.testing.assert_allclose(got.reshape(want.shape), want, rtol=1e-12)


def test_attention_rewrite_keeps_values_and_depth():
    """QK^T and AV (two heads, batch axes (1, heads)): same numbers and depth as the MatMul circuit."""
    model, x = _attention()
    proto, _ = to_onnx_model(model, x.shape[1:])
    circuit = lower_onnx(proto)
    assert sum(isinstance(n, MatMulNode) for n in circuit.nodes) == 2
    expanded = expand_matmuls(circuit, 8192, algorithm="replicate")
    assert not any(isinstance(n, MatMulNode) for n in expanded.nodes)
    assert sum(isinstance(n, MulNode) for n in expanded.nodes) == sum(not isinstance(n, LinearNode)
                                                                       for n in circuit.nodes) == 3
    assert expanded.depth == circuit.depth  # operands come from linear maps, results feed linear maps
    assert expanded.max_size() == 8 * 2 * 8 * 8  # (n, batch..., k, m) for both products
    assert expanded.degrees()[expanded.output] == circuit.degrees()[circuit.output] == 5
    np.testing.assert_allclose(expanded.evaluate(x), circuit.evaluate(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(expanded.evaluate(x), _torch(model, x), rtol=1e-6, atol=1e-6)
    assert any(isinstance(n, MatMulNode) for n in circuit.nodes)  # the input circuit is left as it was


def test_attention_single_layout_matches_torch():
    model, x = _attention()
    prog = export_ckks(model, calibration=x, layout="single", input_shape=x.shape[1:])
    info = prog.manifest.info
    assert {s.op for s in prog.manifest.steps} == {"linear", "mul"}
    # the cost model may trade a level for fewer diagonals (a gather of its own instead of composed)
    assert info["analyzer"]["levels"] == 7 <= info["depth"] <= 8 and info["degree"] == info["analyzer"]["degree"]
    assert [m["algorithm"] in m["candidates"] for m in info["matmuls"]] == [True, True]
    assert info["products"] == 3 and info["fallbacks"] == []
    want = _torch(model, x[:16])
    assert np.abs(prog.run_plain(x[:16]) - want).max() <= 1e-6 * max(1.0, np.abs(want).max())


def _square_of_gram() -> tuple:
    """(x @ x^T)^2 read straight from the input and squared: neither neighbour of the MatMul is a linear map."""
    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["g"]), helper.make_node("Mul", ["g", "g"], ["y"])]
    graph = helper.make_graph(nodes, "gram", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_input_operand_and_product_reader_cost_their_own_maps():
    model = _square_of_gram()
    circuit = lower_onnx(model)
    expanded = expand_matmuls(circuit, 8192, algorithm="replicate")
    # the input's replica (level 1) runs beside the transposed one (composed, level 1): no level on that side;
    # the square reads the result, so the sum over k is a map of its own: one level
    kinds = [type(n).__name__ for n in expanded.nodes]
    assert kinds == ["LinearNode", "LinearNode", "MulNode", "LinearNode", "MulNode"]
    assert expanded.nodes[0].inputs == [0] and expanded.depth == circuit.depth + 1
    x = np.random.default_rng(3).normal(size=(5, 1, 4, 3))
    np.testing.assert_allclose(expanded.evaluate(x), circuit.evaluate(x), rtol=1e-12)
    prog = export_ckks(model, calibration=x, layout="single")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = np.concatenate([sess.run(None, {"x": row.astype(np.float32)})[0].reshape(1, -1) for row in x])
    np.testing.assert_allclose(prog.run_plain(x), want, rtol=1e-4, atol=1e-4)


def test_batch_layout_keeps_its_matmul_step():
    model, x = _attention()
    prog = export_ckks(model, calibration=x, layout="batch", input_shape=x.shape[1:])
    assert sum(s.op == "matmul" for s in prog.manifest.steps) == 2


def test_past_one_register_it_compiles_with_several():
    """QK^T on 32 tokens with two heads of 32: 65,536 products, over the 16,384 slots of any leveled ring, which
    the single layout refused before; now spread over several registers, same numbers as torch."""
    model, x = _attention(tokens=32, channels=8, heads=2, head_dim=32)
    proto, _ = to_onnx_model(model, x.shape[1:])
    circuit = lower_onnx(proto)
    expanded = expand_matmuls(circuit, 16384)
    assert expanded.max_size() <= 8192 and len(expanded.matmuls) == 2
    assert all(m["registers"] > 1 for m in expanded.matmuls)
    np.testing.assert_allclose(expanded.evaluate(x[:4]), _torch(model, x[:4]), rtol=1e-6, atol=1e-6)


def test_refusal_names_the_size_that_fits():
    model, x = _attention()
    proto, _ = to_onnx_model(model, x.shape[1:])
    with pytest.raises(LoweringError, match=r"fits from 8 slots \(a ring of N=16\) up") as err:
        expand_matmuls(lower_onnx(proto), 4)
    assert "layout='batch'" in str(err.value) and "1x2x8x8x8" in str(err.value)


def _apolynext_tiny():
    """One APolyNeXt-BN cell (PolyAttn mixer: 2 heads of 32 on 2x2 tokens) with APolyNeXt-T's skip scales,
    BatchNorm and row-sum statistics from a few batches as after training."""
    stage = StageConfig(72, 1, 1, 1.0, 2.0, mixer="attn")
    arch = PolyNeXtArch("APolyNeXt-Tiny", (stage,), "lowres", ARCHS["t"].downsample, ARCHS["t"].skip_logits, True)
    torch.manual_seed(0)
    model = build_polynext(arch, norm="bn", num_classes=10, img_size=2, in_chans=1)
    x = np.random.default_rng(0).uniform(0, 1, size=(256, 1, 2, 2))
    model.train()
    with torch.no_grad():
        for start in range(0, 256, 64):
            model(torch.tensor(x[start:start + 64], dtype=torch.float32))
    return model.eval(), x


def test_apolynext_bn_compiles_in_the_single_layout():
    model, x = _apolynext_tiny()
    assert model.cells[0].mixers[0].attn.n_heads == 2
    prog = export_ckks(model, calibration=x[:128], layout="single")
    info = prog.manifest.info
    assert {s.op for s in prog.manifest.steps} == {"linear", "mul"}
    proto, _ = to_onnx_model(model, x.shape[1:])
    factored = frozenset(info.get("level_spend", {}).get("factored", []))
    assert info["depth"] == lower_onnx(proto, factored).depth  # the rewrite adds no level to the circuit it gets
    want = _torch(model, x[200:216])
    model.float()
    assert np.abs(prog.run_plain(x[200:216]) - want).max() <= 1e-6 * max(1.0, np.abs(want).max())


@pytest.mark.fhe
def test_attention_encrypted_on_seal_agrees_with_torch():
    model, x = _attention()
    prog = export_ckks(model, calibration=x, layout="single", input_shape=x.shape[1:], poly_modulus_degree=16384,
                       backend="seal")
    lanes = prog.manifest.samples_per_ciphertext
    assert prog.params.security == "tc128" and lanes == 8  # 1,024-value products in 8192 slots
    client = prog.client()
    server = prog.server(client.public_context())
    got = client.decrypt(server.run(client.encrypt(x[:lanes])))
    want = _torch(model, x[:lanes])
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
