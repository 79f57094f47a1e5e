"""Random small polynomial CNNs written in plain torch, the way users write them, for the CKKS compiler tests.

``random_model(seed)`` draws an input shape, a stem (1x1 conv, strided k x k patch conv, or padded 3x3 conv) and
1-3 blocks from: 1x1 channel mixing (widths change), depthwise 3x3 conv with random weights, the fixed shift conv
(one-hot depthwise kernels moving channel quarters one pixel), BatchNorm2d with random running statistics,
low-rank pairs (C -> r -> C'), residual additions ``x + f(x)`` (also ``x + C(f(x) * g(x))``), Hadamard
products ``f(x) * g(x)``, gates ``x * g(x)`` and squares ``x * x``; then global average pooling and a Linear
head. At most ``MAX_PRODUCTS`` ct x ct products per model so the depth stays small. Weights are float64, scaled by 1/sqrt(fan_in) so values stay O(1) on inputs in [0, 1].
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper
from torch import nn

MAX_PRODUCTS = 3
INPUT_SHAPES = [(1, 8, 8), (2, 8, 8), (3, 6, 6)]
WIDTHS = [4, 6, 8, 12]
STEMS = ["conv1x1", "patch", "conv3x3"]
LINEAR_BLOCKS = ["mix", "depthwise", "shift", "bn", "lowrank", "residual"]
PRODUCT_BLOCKS = ["hadamard", "square", "hadamard", "residual_product", "gate"]  # hadamard drawn twice as often
BRANCHES = ["mix", "dw_mix", "shift_mix", "lowrank", "mix_bn"]  # linear chains inside residuals and products
POOLS = ["adaptive", "mean"]
ALL_KINDS = frozenset(
    [f"stem:{k}" for k in STEMS] + [f"block:{k}" for k in LINEAR_BLOCKS + PRODUCT_BLOCKS]
    + [f"branch:{k}" for k in BRANCHES] + [f"pool:{k}" for k in POOLS]
    + [f"input:{c}x{h}x{w}" for c, h, w in INPUT_SHAPES]
)


@functools.lru_cache(maxsize=1)
def user_models():
    """``bench/user_models.py``: the user-written models the planner benchmark runs (loaded by path)."""
    spec = importlib.util.spec_from_file_location("user_models", Path(__file__).resolve().parents[2] / "bench"
                                                  / "user_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shift_conv(channels: int) -> nn.Conv2d:
    """The frozen depthwise 3x3 convolution moving each quarter of the channels one pixel, in float64."""
    return user_models().shift_conv(channels).double()


class Residual(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class Hadamard(nn.Module):
    def __init__(self, f: nn.Module, g: nn.Module) -> None:
        super().__init__()
        self.f, self.g = f, g

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.f(x) * self.g(x)


class Square(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


class Net(nn.Module):
    def __init__(self, stem: nn.Module, blocks: nn.Module, head: nn.Linear, pool: str) -> None:
        super().__init__()
        self.stem, self.blocks, self.pool_kind = stem, blocks, pool
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        x = torch.flatten(self.pool(x), 1) if self.pool_kind == "adaptive" else x.mean(dim=(2, 3))
        return self.head(x)


@dataclass
class RandomGraph:
    seed: int
    model: nn.Module
    input_shape: tuple[int, int, int]
    description: str
    products: int
    kinds: frozenset[str]  # what the generator drew ("stem:patch", "block:hadamard", ...), for coverage checks


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.products = 0
        self.parts: list[str] = []
        self.kinds: set[str] = set()

    def _init(self, module: nn.Module) -> nn.Module:
        """Random float64 weights scaled by 1/sqrt(fan_in) (+ small biases)."""
        module = module.double()
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            w = module.weight
            fan_in = int(np.prod(w.shape[1:]))
            w.data.copy_(torch.from_numpy(self.rng.normal(0.0, 1.0 / np.sqrt(fan_in), size=tuple(w.shape))))
            if module.bias is not None:
                module.bias.data.copy_(torch.from_numpy(self.rng.uniform(-0.3, 0.3, size=tuple(module.bias.shape))))
        return module

    def conv1x1(self, c_in: int, c_out: int) -> nn.Module:
        return self._init(nn.Conv2d(c_in, c_out, 1, bias=bool(self.rng.random() < 0.7)))

    def depthwise(self, c: int) -> nn.Module:
        return self._init(nn.Conv2d(c, c, 3, padding=1, groups=c, bias=bool(self.rng.random() < 0.5)))

    def batchnorm(self, c: int) -> nn.Module:
        bn = nn.BatchNorm2d(c).double()
        bn.weight.data.copy_(torch.from_numpy(self.rng.uniform(0.5, 1.5, c)))
        bn.bias.data.copy_(torch.from_numpy(self.rng.uniform(-0.5, 0.5, c)))
        bn.running_mean.copy_(torch.from_numpy(self.rng.uniform(-0.5, 0.5, c)))
        bn.running_var.copy_(torch.from_numpy(self.rng.uniform(0.3, 2.0, c)))
        return bn.eval()

    def linear_chain(self, c_in: int, c_out: int) -> tuple[nn.Module, str]:
        """1-2 linear ops mapping c_in -> c_out channels (spatial ops only keep the width)."""
        kind = str(self.rng.choice(BRANCHES))
        self.kinds.add(f"branch:{kind}")
        if kind == "mix":
            return self.conv1x1(c_in, c_out), f"mix{c_in}>{c_out}"
        if kind == "dw_mix":
            return nn.Sequential(self.depthwise(c_in), self.conv1x1(c_in, c_out)), f"dw{c_in}+mix>{c_out}"
        if kind == "shift_mix":
            return nn.Sequential(self.conv1x1(c_in, c_out), shift_conv(c_out)), f"mix{c_in}>{c_out}+shift"
        if kind == "lowrank":
            r = int(self.rng.integers(1, max(2, min(c_in, c_out) // 2) + 1))
            return nn.Sequential(self.conv1x1(c_in, r), self.conv1x1(r, c_out)), f"lowrank{c_in}>{r}>{c_out}"
        return nn.Sequential(self.conv1x1(c_in, c_out), self.batchnorm(c_out)), f"mix{c_in}>{c_out}+bn"

    def block(self, c: int) -> tuple[nn.Module, int, str]:
        """One block on c channels: (module, output channels, description)."""
        kind = str(self.rng.choice(LINEAR_BLOCKS + (PRODUCT_BLOCKS if self.products < MAX_PRODUCTS else [])))
        self.kinds.add(f"block:{kind}")
        if kind == "mix":
            c_out = int(self.rng.choice(WIDTHS))
            return self.conv1x1(c, c_out), c_out, f"mix{c}>{c_out}"
        if kind == "depthwise":
            return self.depthwise(c), c, f"dw{c}"
        if kind == "shift":
            return shift_conv(c), c, f"shift{c}"
        if kind == "bn":
            return self.batchnorm(c), c, f"bn{c}"
        if kind == "lowrank":
            c_out = int(self.rng.choice(WIDTHS))
            r = int(self.rng.integers(1, max(2, c // 2) + 1))
            return nn.Sequential(self.conv1x1(c, r), self.conv1x1(r, c_out)), c_out, f"lowrank{c}>{r}>{c_out}"
        if kind == "residual":
            body, text = self.linear_chain(c, c)
            return Residual(body), c, f"res({text})"
        if kind == "square":
            self.products += 1
            return Square(), c, "sq"
        if kind == "gate":  # x * g(x): one operand is the block's input register itself
            self.products += 1
            g, g_text = self.linear_chain(c, c)
            return Hadamard(nn.Identity(), g), c, f"gate(x*{g_text})"
        c_mid = int(self.rng.choice(WIDTHS))
        self.products += 1
        f, f_text = self.linear_chain(c, c_mid)
        g, g_text = self.linear_chain(c, c_mid)
        if kind == "hadamard":
            return Hadamard(f, g), c_mid, f"had({f_text}*{g_text})"
        back, back_text = self.linear_chain(c_mid, c)  # x + C(f(x) * g(x)), as a Mu-Layer's gated branch
        return Residual(nn.Sequential(Hadamard(f, g), back)), c, f"res(had({f_text}*{g_text})>{back_text})"

    def build(self) -> tuple[nn.Module, tuple[int, int, int], str]:
        shape = INPUT_SHAPES[int(self.rng.integers(len(INPUT_SHAPES)))]
        c_in, h, _ = shape
        width = int(self.rng.choice(WIDTHS))
        stem_kind = str(self.rng.choice(STEMS))
        if stem_kind == "conv1x1":
            stem, text = self.conv1x1(c_in, width), f"stem1x1:{c_in}>{width}"
        elif stem_kind == "patch":
            k = int(self.rng.choice([k for k in (2, 3, 4) if h % k == 0 and h // k >= 2]))
            stem = self._init(nn.Conv2d(c_in, width, k, stride=k))
            text = f"patch{k}x{k}/{k}:{c_in}>{width}"
        else:
            stem, text = self._init(nn.Conv2d(c_in, width, 3, padding=1)), f"stem3x3:{c_in}>{width}"
        self.parts.append(text)
        self.kinds.update({f"stem:{stem_kind}", f"input:{c_in}x{h}x{h}"})
        blocks, c = [], width
        for _ in range(int(self.rng.integers(1, 4))):
            module, c, text = self.block(c)
            blocks.append(module)
            self.parts.append(text)
        classes = int(self.rng.integers(3, 11))
        pool = str(self.rng.choice(POOLS))
        self.kinds.add(f"pool:{pool}")
        self.parts.append(f"{pool}pool>fc{c}>{classes}")
        head = self._init(nn.Linear(c, classes))
        model = Net(stem, nn.Sequential(*blocks), head, pool).double().eval()
        return model, shape, " | ".join(self.parts)


def random_model(seed: int) -> RandomGraph:
    """A reproducible random polynomial CNN (float64, eval mode) for ``seed``."""
    builder = _Builder(seed)
    model, shape, text = builder.build()
    return RandomGraph(seed, model, shape, f"{shape[0]}x{shape[1]}x{shape[2]} {text}", builder.products,
                       frozenset(builder.kinds))


def calibration_inputs(graph: RandomGraph, n: int = 16, seed: int = 1) -> np.ndarray:
    """``n`` inputs of the model's shape, uniform in [0, 1], float64."""
    return np.random.default_rng(seed * 1000 + graph.seed).uniform(0.0, 1.0, size=(n, *graph.input_shape))


def torch_forward(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(x, dtype=np.float64))).numpy()


def _to_double(tensor: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name)


def onnx_float64(path) -> onnx.ModelProto:
    """The ONNX file at ``path`` with every float32 tensor (weights, constants, inputs, outputs) made float64.

    The exported weights stay the float32 values the compiler reads; only the arithmetic becomes float64, so the
    reference and the compiled program differ by rounding of the order of 1e-15, not float32's 1e-7.
    """
    model = onnx.load(str(path))
    graph = model.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(_to_double(init))
    for node in graph.node:
        if node.op_type == "Cast":
            raise ValueError("Cast nodes are not expected in these exports")
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(_to_double(attr.t))
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    return model


def onnx_reference(path, x: np.ndarray) -> np.ndarray:
    """Outputs of the ONNX file at ``path`` on ``x``, computed in float64 by onnx's reference evaluator.

    (onnxruntime's CPU Conv kernel has no float64 implementation, so it can only give a float32 reference.)
    """
    from onnx.reference import ReferenceEvaluator

    model = onnx_float64(path)
    (name,) = [i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    out = ReferenceEvaluator(model).run(None, {name: np.asarray(x, dtype=np.float64)})[0]
    if out.dtype != np.float64:
        raise TypeError(f"the float64 reference computed in {out.dtype}")
    return out.reshape(len(x), -1)
