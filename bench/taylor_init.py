"""Taylor initialisation vs Xavier vs Kaiming: one model, one training budget, several seeds.

Trains a registered Taylor model (default ``taylornet``: 784 -> 64 -> 64 Taylor layers of order 2, rank 16,
degree 4, no activation and no normalisation) on a Fashion-MNIST subset with each of the Taylor layer's
initialisation schemes (:mod:`polyfhe.models.layers.taylor`), the same optimiser, schedule, data order and number
of steps for every scheme, over ``--seeds`` seeds. Prints a table (test accuracy mean +- std, final train loss,
diverged runs) with the machine's details and writes ``results.md``, ``results.json`` and ``taylor_init.png``
to ``--out``.

    python bench/taylor_init.py --out runs/taylor_init                    # default: ~3 min on 2 CPU cores
    python bench/taylor_init.py --model taylor_mixer --train 4000 --out runs/taylor_init_mixer

A run counts as diverged when its loss becomes NaN/inf or exceeds ``--diverge-loss``; it stops there and its
accuracy is left out of the mean (the table gives the count). Images are standardised with the training
subset's mean and std (one scalar each, the same for every scheme).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import machine_info

import polyfhe
from polyfhe.data.sources import load_dataset
from polyfhe.models.layers.taylor import TAYLOR_INITS

log = logging.getLogger("taylor_init")


@dataclass
class Run:
    init: str
    seed: int
    diverged: bool
    test_accuracy: float | None
    final_train_loss: float | None
    initial_loss: float
    epoch_losses: list[float] = field(default_factory=list)
    seconds: float = 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="taylornet", help="registered Taylor model (taylornet, rtaylornet, taylor_mixer)")
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--train", type=int, default=60000, help="training subset size (60000: all)")
    p.add_argument("--test", type=int, default=10000, help="test subset size (10000: all)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--inits", nargs="+", default=list(TAYLOR_INITS), choices=TAYLOR_INITS)
    p.add_argument("--diverge-loss", type=float, default=1e3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1 was fastest for the default model on a loaded 2-core machine)")
    p.add_argument("--out", type=Path, default=Path("runs/taylor_init"))
    return p.parse_args(argv)


def load_subset(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    data = load_dataset(args.dataset)
    pick = np.random.default_rng(0)
    tr = pick.permutation(len(data.x_train))[:args.train]
    te = pick.permutation(len(data.x_test))[:args.test]
    x_tr, x_te = data.x_train[tr].astype(np.float32), data.x_test[te].astype(np.float32)
    mean, std = float(x_tr.mean()), float(x_tr.std())
    return (torch.tensor((x_tr - mean) / std), torch.tensor(data.y_train[tr], dtype=torch.long),
            torch.tensor((x_te - mean) / std), torch.tensor(data.y_test[te], dtype=torch.long))


def train_one(args: argparse.Namespace, init: str, seed: int, data: tuple[torch.Tensor, ...]) -> Run:
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(seed)
    model = polyfhe.create_model(args.model, init=init, img_size=x_tr.shape[-1], in_chans=x_tr.shape[1])
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = args.epochs * math.ceil(len(x_tr) / args.batch_size)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    order = torch.Generator().manual_seed(seed)  # the same batches for every init at a given seed
    with torch.no_grad():
        initial = float(F.cross_entropy(model(x_tr[:1000]), y_tr[:1000]))
    start, epoch_losses, diverged = time.perf_counter(), [], not math.isfinite(initial)
    model.train()
    for _ in range(args.epochs if not diverged else 0):
        perm, total, seen = torch.randperm(len(x_tr), generator=order), 0.0, 0
        for i in range(0, len(x_tr), args.batch_size):
            idx = perm[i:i + args.batch_size]
            loss = F.cross_entropy(model(x_tr[idx]), y_tr[idx])
            if not math.isfinite(loss.item()) or loss.item() > args.diverge_loss:
                diverged = True
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total, seen = total + loss.item() * len(idx), seen + len(idx)
        if diverged:
            break
        epoch_losses.append(total / seen)
    acc = None
    if not diverged:
        model.eval()
        with torch.no_grad():
            logits = torch.cat([model(x_te[i:i + 500]) for i in range(0, len(x_te), 500)])
        acc = float((logits.argmax(1) == y_te).float().mean()) if torch.isfinite(logits).all() else None
        diverged = acc is None
    run = Run(init, seed, diverged, acc, epoch_losses[-1] if epoch_losses and not diverged else None, initial,
              epoch_losses, time.perf_counter() - start)
    log.info("%s seed %d: %s", init, seed, asdict(run))
    return run


def _mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{np.mean(values):.4f} +- {np.std(values, ddof=1) if len(values) > 1 else 0.0:.4f}"


def summarise(runs: list[Run], inits: list[str]) -> list[dict]:
    rows = []
    for init in inits:
        mine = [r for r in runs if r.init == init]
        ok = [r for r in mine if not r.diverged]
        rows.append({
            "init": init, "runs": len(mine), "diverged": len(mine) - len(ok),
            "test_accuracy": _mean_std([r.test_accuracy for r in ok]),
            "final_train_loss": _mean_std([r.final_train_loss for r in ok]),
            "initial_loss": _mean_std([r.initial_loss for r in mine if math.isfinite(r.initial_loss)]),
            "seconds_per_run": f"{np.mean([r.seconds for r in mine]):.1f}" if mine else "n/a",
        })
    return rows


def markdown(rows: list[dict], header: str) -> str:
    cols = ["init", "runs", "diverged", "test_accuracy", "final_train_loss", "initial_loss", "seconds_per_run"]
    lines = [header, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], inits: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    labels = []
    for pos, init in enumerate(inits):
        mine = [r for r in runs if r.init == init]
        ok = [r for r in mine if not r.diverged]
        labels.append(f"{init}\n({len(mine) - len(ok)}/{len(mine)} diverged)")
        if ok:
            ax_loss.plot(range(1, len(ok[0].epoch_losses) + 1), np.mean([r.epoch_losses for r in ok], axis=0),
                         marker="o", label=init)
            accs = [r.test_accuracy for r in ok]
            ax_acc.scatter([pos] * len(accs), accs, alpha=0.7)
            ax_acc.errorbar([pos], [np.mean(accs)], yerr=[np.std(accs)], fmt="_", color="k", capsize=6)
    ax_acc.set_xticks(range(len(inits)), labels)
    ax_acc.set_xlim(-0.5, len(inits) - 0.5)
    ax_loss.set(xlabel="epoch", ylabel="train loss (mean over seeds)", yscale="log", title="training loss")
    ax_loss.legend()
    ax_acc.set(ylabel="test accuracy", title="test accuracy per seed (bar: mean +- std)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    data = load_subset(args)
    info = machine_info()
    n_params = sum(p.numel() for p in polyfhe.create_model(args.model, img_size=data[0].shape[-1],
                                                           in_chans=data[0].shape[1]).parameters())
    header = (f"Taylor init vs Xavier vs Kaiming: {args.model} ({n_params} parameters) on {args.dataset} "
              f"({len(data[0])} train / {len(data[2])} test), {args.epochs} epochs, batch {args.batch_size}, "
              f"Adam lr {args.lr} cosine, {args.seeds} seeds\n\nmachine: {info['cpu']}, {info['usable_cores']} "
              f"usable cores ({info['cores']} total), load {info['load_avg_1m']:.2f}, torch threads "
              f"{args.threads}, Python {info['python']}, {info['platform']}")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[Run] = []
    for seed in range(args.seeds):
        for init in args.inits:
            runs.append(train_one(args, init, seed, data))
    rows = summarise(runs, args.inits)
    table = markdown(rows, header)
    (args.out / "results.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(
        {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
         "machine": info, "parameters": n_params, "summary": rows, "runs": [asdict(r) for r in runs]},
        indent=2) + "\n")
    plot(runs, args.inits, args.out / "taylor_init.png")
    print(table)  # a bench script prints its table (library code does not)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
