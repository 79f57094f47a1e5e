"""Run by tests/training/test_distributed.py under ``torch.distributed.run --nproc-per-node 2`` (gloo, CPU).

Records which training images each rank's steps received. The data set gives every training image a label of its
own, so the (smoothed one-hot) targets of a step name the images it trained on, and the logits' rows count the images
that went through the model. Trains twice in one process group:

1. ``split/``: the library as it is; each rank should see only its share of every global batch.
2. ``replicated/``: :meth:`DistContext.shard` replaced by a non-distributed "sampler" that hands every rank the
   whole global batch (a negative control: the test's checks must reject this run).

Each rank writes ``<out>/<run>/shares-<rank>.json``: ``steps`` (per step the number of logits rows and the labels).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist
from torch import Tensor

from polyfhe.data.sources import ImageDataset
from polyfhe.training import loop, train
from polyfhe.training.distributed import DistContext, setup

N_TRAIN, N_TEST = 320, 32
# 320 images, val_fraction 0.1: 288 train images, 9 global batches of 32 a epoch (none dropped), 16 per rank
TRAIN = {"device": "cpu", "batch_size": 32, "epochs": 2, "progress": False, "optimizer": "sgd", "lr": 0.05,
         "val_fraction": 0.1, "model_kwargs": {"dims": [16], "depths": [1]}}
MODEL = "monet_lr_bn"
TRAIN_LOSS = loop.soft_cross_entropy


def unique_labels() -> ImageDataset:
    """Random 8x8 images, image i of the training set labelled i (one class per image)."""
    rng = np.random.default_rng(0)
    x_train = rng.random((N_TRAIN, 1, 8, 8), dtype=np.float32)
    x_test = rng.random((N_TEST, 1, 8, 8), dtype=np.float32)
    return ImageDataset("shares", x_train, np.arange(N_TRAIN), x_test, np.arange(N_TEST),
                        tuple(str(i) for i in range(N_TRAIN)))


def record_steps(steps: list[dict]) -> None:
    """Wrap the loop's training loss: it sees this rank's logits and targets of every step (evaluation uses
    another loss), so it records what this rank's step trained on."""

    def recording(logits: Tensor, targets: Tensor) -> Tensor:
        steps.append({"rows": int(logits.shape[0]), "labels": targets.argmax(1).tolist()})
        return TRAIN_LOSS(logits, targets)

    loop.soft_cross_entropy = recording


def main() -> int:
    out = Path(sys.argv[1])
    ctx, _ = setup("cpu")  # torchrun's variables: opens the gloo group that train() then joins
    assert ctx.enabled and ctx.backend == "gloo"
    for run in ("split", "replicated"):
        if run == "replicated":
            DistContext.shard = lambda self, n: slice(0, n)  # every rank takes the whole global batch
        steps: list[dict] = []
        record_steps(steps)
        train(MODEL, unique_labels(), TRAIN["epochs"], out / run, **{k: v for k, v in TRAIN.items()
                                                                     if k != "epochs"})
        (out / run).mkdir(parents=True, exist_ok=True)
        (out / run / f"shares-{ctx.rank}.json").write_text(json.dumps({"rank": ctx.rank, "world": ctx.world_size,
                                                                        "steps": steps}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
