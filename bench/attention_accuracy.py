"""Train the user-written polynomial attention network (``user_models.UserAttentionBN``) on Fashion-MNIST.

    python bench/attention_accuracy.py --epochs 10 --out runs/attention
    python bench/ckks_plans.py --cases user_attention --model-file runs/attention/model.pt

Adam with a cosine decay of the learning rate, batch 128, no augmentation; the test accuracy of the eval-mode model
(BatchNorm statistics and the running l1 constants frozen: the polynomial that runs encrypted) after every epoch.
The eval model is saved pickled as ``OUT/model.pt`` (``torch.save(model)``, loadable without this file's code on the
path only where ``user_models`` is importable: ``bench/`` does that for ``ckks_plans.py``), with ``results.json``
(per-epoch accuracy, wall time, the analyzer's degree and levels, the machine).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_info import machine_info
from user_models import UserAttentionBN

log = logging.getLogger("bench.attention_accuracy")


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1000) -> float:
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum()) for i in range(0, len(x), batch))
    return hits / len(x)


def train(model: nn.Module, data, epochs: int, lr: float, batch: int, seed: int, train_subset: int | None = None,
          weight_decay: float = 0.0) -> list[dict]:
    """Adam (``weight_decay`` > 0: AdamW) with a per-step cosine decay from ``lr`` to 0; one row per epoch."""
    torch.manual_seed(seed)
    x = torch.from_numpy(data.x_train[:train_subset])
    y = torch.from_numpy(data.y_train[:train_subset]).long()
    xt, yt = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test).long()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay) if weight_decay
           else torch.optim.Adam(params, lr=lr))
    steps = epochs * math.ceil(len(x) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rows, start = [], time.perf_counter()
    for epoch in range(1, epochs + 1):
        model.train()
        order, losses, hits = torch.randperm(len(x)), [], 0
        for i in range(0, len(x), batch):
            idx = order[i:i + batch]
            logits = model(x[idx])
            loss = nn.functional.cross_entropy(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, 5.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            hits += int((logits.argmax(1) == y[idx]).sum())
        row = {"epoch": epoch, "loss": float(np.mean(losses)), "train_acc": hits / len(x),
               "test_acc": evaluate(model, xt, yt), "wall_s": time.perf_counter() - start}
        rows.append(row)
        print(f"epoch {epoch:3d}  loss {row['loss']:.4f}  train {row['train_acc']:.2%}  "
              f"test (eval mode) {row['test_acc']:.2%}  {row['wall_s']:.0f} s", flush=True)
    return rows


def analysis(model: nn.Module, folder: Path) -> dict:
    """The analyzer's view of the eval model's ONNX export: degree, ct x ct depth, levels."""
    import polyfhe

    path = polyfhe.export(model, target="onnx", path=folder / "model.onnx", input_shape=(1, 28, 28))
    report = polyfhe.analyze(path)
    return {"polynomial": report.polynomial, "degree": report.degree, "mult_depth": report.mult_depth,
            "levels": report.levels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.0, help="> 0: AdamW with this decay")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-subset", type=int, help="first N training images only (a quick run)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("runs/attention"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from polyfhe.data.sources import load_dataset

    data = load_dataset("fashion-mnist")
    info = machine_info()
    torch.manual_seed(args.seed)
    model = UserAttentionBN()
    rows = train(model, data, args.epochs, args.lr, args.batch, args.seed, args.train_subset, args.weight_decay)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model, args.out / "model.pt")
    report = analysis(model, args.out)
    result = {"machine": info, "epochs": args.epochs, "lr": args.lr, "weight_decay": args.weight_decay,
              "batch": args.batch, "seed": args.seed, "train_images": len(data.x_train[:args.train_subset]),
              "test_images": len(data.x_test), "rows": rows, "analysis": report,
              "running_l1": [float(b.scale.running_denom) for b in model.blocks]}
    (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print()
    print("| machine | cpu | usable cores | load (1 min) | Python |")
    print("|---|---|---:|---:|---|")
    print(f"| this | {info['cpu']} | {info['usable_cores']} | {info['load_avg_1m']:.2f} | {info['python']} |")
    print()
    print("| epochs | lr | test accuracy (eval mode) | training wall time (s) | degree | ct x ct depth | levels |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {args.epochs} | {args.lr:g} | {rows[-1]['test_acc']:.2%} | {rows[-1]['wall_s']:.0f} | "
          f"{report['degree']} | {report['mult_depth']} | {report['levels']} |")
    print(f"\nsaved {args.out / 'model.pt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
