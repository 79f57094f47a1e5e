"""A ReLU CNN made to run encrypted: train it, ``polyfhe.polynomialize`` it, export it to CKKS, run test images.

Trains a small ReLU CNN with max pooling (plain PyTorch, the way a user would) on ``--dataset``, then
``polyfhe.polynomialize(model, data=(X, y))`` swaps every ReLU for a degree-2 polynomial fitted to the values that
reach it and the max pooling for average pooling, and fine-tunes for ``--ft-epochs``. The result is exported with
``polyfhe.export(target="ckks")`` (SEAL, the default 128-bit parameters, single layout) and ``--images`` test
images run encrypted: latency per ciphertext (cold = the first query, warm = the median of the rest) and the
agreement of the decrypted class with the plaintext polynomial model's. Prints a table with the machine's
details and writes ``results.json`` and ``results.md`` to ``--out``.

    python bench/polynomialize.py                          # Fashion-MNIST from the data module's default folder
    python bench/polynomialize.py --dataset digits         # scikit-learn's 8x8 digits: seconds
    python bench/polynomialize.py --root ~/data/fashion    # a folder holding the four IDX files
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine_info

import polyfhe
from polyfhe.data.sources import open_dataset

log = logging.getLogger("polynomialize")


def relu_cnn(in_chans: int, img_size: int, classes: int, width: int) -> nn.Module:
    """conv-BN-ReLU-maxpool, conv(stride 2)-BN-ReLU, linear head: what a first CNN looks like."""
    side = (img_size // 2 + 1) // 2
    return nn.Sequential(
        nn.Conv2d(in_chans, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * width * side * side, classes),
    )


def train_plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float,
                batch_size: int) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for epoch in range(epochs):
        perm, total = torch.randperm(len(x), generator=generator), 0.0
        for i in range(0, len(x), batch_size):
            idx = perm[i:i + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        log.info("ReLU CNN epoch %d/%d: loss %.4f", epoch + 1, epochs, total / len(x))
    return model.eval()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    pred = torch.cat([model(x[i:i + 1000]).argmax(1) for i in range(0, len(x), 1000)])
    return float((pred == y).float().mean())


def run_encrypted(prog, poly: nn.Module, images: np.ndarray) -> dict:
    """Encrypt, run and decrypt ``images`` one ciphertext at a time; latencies and agreement with plaintext."""
    client = prog.client()
    server = prog.server(client.public_context())
    lanes = prog.manifest.samples_per_ciphertext
    walls, totals, outs = [], [], []
    for i in range(0, len(images), lanes):
        t0 = time.perf_counter()
        query = client.encrypt(images[i:i + lanes])
        t1 = time.perf_counter()
        answer = server.run(query)
        t2 = time.perf_counter()
        outs.append(client.decrypt(answer))
        walls.append(t2 - t1)
        totals.append(time.perf_counter() - t0)
    encrypted = np.concatenate(outs)[:len(images)]
    with torch.no_grad():
        plain = poly(torch.tensor(images, dtype=torch.float32)).numpy()
    return {
        "images": len(images), "samples_per_ciphertext": lanes,
        "server_cold_s": walls[0], "server_warm_s": float(np.median(walls[1:])) if len(walls) > 1 else None,
        "client_and_server_cold_s": totals[0],
        "client_and_server_warm_s": float(np.median(totals[1:])) if len(totals) > 1 else None,
        "agreement": float((encrypted.argmax(1) == plain.argmax(1)).mean()),
        "max_abs_logit_error": float(np.abs(encrypted - plain).max()),
        "max_abs_logit": float(np.abs(plain).max()),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="fashion-mnist", help="a source name (fashion-mnist, digits, ...) or a path")
    p.add_argument("--root", type=Path, default=None, help="the folder holding --dataset's files (default: the "
                   "data module's own default for that source)")
    p.add_argument("--train", type=int, default=60000, help="training images used (all when larger)")
    p.add_argument("--width", type=int, default=8, help="channels of the first convolution")
    p.add_argument("--epochs", type=int, default=3, help="epochs of plain training of the ReLU CNN")
    p.add_argument("--ft-epochs", type=int, default=2, help="epochs of fine-tuning after polynomialize")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ft-lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--images", type=int, default=8, help="test images run encrypted (at least three ciphertexts)")
    p.add_argument("--threads", type=int, default=2, help="torch threads for training")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "polynomialize")
    return p.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    data = open_dataset(args.dataset, root=args.root)
    pick = np.random.default_rng(0).permutation(len(data.x_train))[:args.train]
    x, y = torch.tensor(data.x_train[pick]), torch.tensor(data.y_train[pick])
    x_test, y_test = torch.tensor(data.x_test), torch.tensor(data.y_test)
    torch.manual_seed(0)
    c, h, _ = data.x_train.shape[1:]
    model = relu_cnn(c, h, data.num_classes, args.width)
    t0 = time.perf_counter()
    train_plain(model, x, y, args.epochs, args.lr, args.batch_size)
    train_s = time.perf_counter() - t0
    relu_acc = accuracy(model, x_test, y_test)
    t0 = time.perf_counter()
    poly = polyfhe.polynomialize(model, data=(x, y), eval_data=(x_test, y_test), epochs=args.ft_epochs,
                                 lr=args.ft_lr, batch_size=args.batch_size)
    poly_s = time.perf_counter() - t0
    report = poly.polynomialize_report
    t0 = time.perf_counter()
    prog = polyfhe.export(poly, target="ckks", calibration=data.x_train[:256], input_shape=(c, h, h))
    export_s = time.perf_counter() - t0
    lanes = prog.manifest.samples_per_ciphertext  # at least three ciphertexts: one cold query, two warm ones
    encrypted = run_encrypted(prog, poly, data.x_test[:max(args.images, 3 * lanes)])
    params = prog.manifest.params
    return {
        "dataset": data.name, "train_images": len(x), "test_images": len(x_test), "model": str(model),
        "relu_train_s": train_s, "relu_test_accuracy": relu_acc,
        "polynomialize_s": poly_s, "polynomialize": report.to_dict(),
        "export_s": export_s, "degree": prog.manifest.info.get("degree"),
        "params": {"poly_modulus_degree": params.poly_modulus_degree, "coeff_mod_bits": list(params.coeff_mod_bits),
                   "scale_bits": params.scale_bits, "security": params.security},
        "encrypted": encrypted, "machine": machine_info(), "torch_threads": args.threads,
    }


def pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}%"


def render(result: dict) -> str:
    rep, enc, par = result["polynomialize"], result["encrypted"], result["params"]
    warm = enc["server_warm_s"]
    rows = [
        ("ReLU CNN, test accuracy", pct(result["relu_test_accuracy"]),
         f"{result['relu_train_s']:.0f} s training on {result['train_images']} images"),
        ("polynomial fit only (no fine-tune)", pct(rep["accuracy_fitted"]),
         ", ".join(f"{r['path']}: {r['was']} -> {r['now']}" for r in rep["replaced"])),
        (f"after {rep['epochs']} fine-tune epochs", pct(rep["accuracy_final"]),
         f"{result['polynomialize_s']:.0f} s polynomialize (fit + fine-tune)"),
        ("CKKS program", f"degree {result['degree']}",
         (f"N={par['poly_modulus_degree']}, {len(par['coeff_mod_bits'])} primes, {par['security']}, "
          f"export {result['export_s']:.1f} s")),
        ("encrypted latency per ciphertext", f"{enc['server_cold_s']:.2f} s cold"
         + (f", {warm:.2f} s warm ({warm / enc['samples_per_ciphertext']:.3f} s per image)"
            if warm is not None else ""),
         (f"{enc['samples_per_ciphertext']} image(s) per ciphertext, server only; with client "
          f"{enc['client_and_server_cold_s']:.2f} s cold")),
        (f"encrypted vs plaintext ({enc['images']} test images)", f"{pct(enc['agreement'])} same class",
         f"max abs logit error {enc['max_abs_logit_error']:.2e} (logits up to {enc['max_abs_logit']:.1f})"),
    ]
    lines = [f"polynomialize on {result['dataset']}", "",
             "machine: " + ", ".join(f"{k} {v}" for k, v in result["machine"].items()), "",
             "| stage | result | detail |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        handlers=[logging.StreamHandler(sys.stderr)])
    torch.set_num_threads(args.threads)
    result = measure(args)
    table = render(result)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    (args.out / "results.md").write_text(table + "\n")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
