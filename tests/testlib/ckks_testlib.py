"""Small polynomial models for the CKKS tests, trained briefly on scikit-learn digits (8x8)."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn


def _load_toys():
    """bench/toy_models.py: the small models and the digits trainer the benchmarks share with these tests."""
    path = Path(__file__).resolve().parents[2] / "bench" / "toy_models.py"
    spec = importlib.util.spec_from_file_location("polyfhe_bench_toy_models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_toys = _load_toys()
Square, Cube, digits, train = _toys.Square, _toys.Cube, _toys.digits, _toys.train
StemNet, DeepResidual, ShiftBlocks = _toys.StemNet, _toys.DeepResidual, _toys.ShiftBlocks
LinearAttention = _toys.LinearAttention


def encrypted_and_plain(model: nn.Module, x: np.ndarray, min_samples: int = 16, backend: str = "seal",
                        input_shape: tuple[int, ...] = (1, 8, 8)) -> tuple[np.ndarray, np.ndarray]:
    """Logits of the first rows of ``x`` (at least ``min_samples``, whole ciphertexts) run encrypted in the single
    layout, and the float64 plaintext logits of the same rows."""
    from polyfhe.exporters.ckks import export_ckks

    prog = export_ckks(model, calibration=x[:64], layout="single", input_shape=input_shape, backend=backend)
    client = prog.client()
    server = prog.server(client.public_context())
    lanes = prog.manifest.samples_per_ciphertext
    rows = x[:max(min_samples, lanes)]
    enc = np.concatenate([client.decrypt(server.run(client.encrypt(rows[i:i + lanes])))
                          for i in range(0, len(rows), lanes)])
    with torch.no_grad():
        plain = model(torch.tensor(rows, dtype=torch.float32)).numpy().astype(np.float64)
    return enc, plain


def _trained_once(build):
    """``build()`` (seeded, so always the same model) runs once per session: later calls get a deep copy, and the
    torch RNG state training left behind, so that a caller sees what a fresh training would have given it."""
    cache: list = []

    @functools.wraps(build)
    def get() -> nn.Module:
        if not cache:
            model = build()
            cache.append((model, torch.get_rng_state()))
        model, state = cache[0]
        torch.set_rng_state(state)
        return copy.deepcopy(model)

    return get


@_trained_once
def digits_mlp() -> nn.Module:
    """64 -> 32 -> x^2 -> 10, trained on digits (a dozen test files use it: trained once per session)."""
    torch.manual_seed(0)
    return train(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), Square(), nn.Linear(32, 10)))


def digits_program():
    """(the digits MLP compiled for SEAL's single layout on 64 calibration samples, the test images)."""
    from polyfhe.exporters.ckks import export_ckks

    _, _, x, _ = digits()
    return export_ckks(digits_mlp(), calibration=x[:64], input_shape=(1, 8, 8)), x


@_trained_once
def square_cnn() -> nn.Module:
    """Depthwise, dilated and strided convolutions, BN, x^2, x^3 via Pow, average pooling, a Gemm head."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), Square(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=4), nn.Conv2d(4, 6, 3, stride=2, padding=1),
        nn.BatchNorm2d(6), Cube(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(24, 10),
    )
    return train(model, epochs=20, lr=0.005)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        return float((model(torch.tensor(x, dtype=torch.float32)).argmax(1).numpy() == y).mean())


def export_square_mlp(hidden: int, classes: int, calibration_samples: int = 64, **kwargs):
    """An untrained 64 -> hidden -> x^2 -> classes MLP exported for CKKS (random 8x8 calibration): programs of
    a few MB of keys, for tests of what travels rather than what is learned."""
    import polyfhe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), Square(), nn.Linear(hidden, classes)).eval()
    calib = np.random.default_rng(0).random((calibration_samples, 1, 8, 8)).astype(np.float32)
    return polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 8, 8), **kwargs)


def export_bootstrapping_mlp(backend: str = "lattigo"):
    """A 64 -> 16 -> x^2 -> 16 -> x^2 -> 10 MLP on the insecure N=4096 ring with three levels: too deep for it, so
    it bootstraps (on its own ring, six special primes; seconds of keys): the smallest bootstrapping program."""
    from polyfhe.exporters.ckks import export_ckks
    from polyfhe.program.params import CKKSParams

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Square(), nn.Linear(16, 16), Square(), nn.Linear(16, 10))
    ring = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
    prog = export_ckks(model.eval(), calibration=digits()[0][:32], input_shape=(1, 8, 8), backend=backend,
                       params=ring, allow_insecure=True)
    assert prog.manifest.bootstrap_spec
    return prog


BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def bench_module(name: str):
    """``bench/NAME.py`` imported under a private name, with bench/ on sys.path while it is in use (benchmarks
    import their siblings by name)."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}_under_test", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
