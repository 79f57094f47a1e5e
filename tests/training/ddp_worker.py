"""Run by tests/training/test_distributed.py under ``torch.distributed.run --nproc-per-node 2`` (gloo, CPU).

1. Each synchronised norm (TokenBatchNorm, ChannelBatchNorm, RunningRowSumNorm, BatchNorm2d) on this rank's half
   of a batch must give the rows, input gradients, parameter gradients and running statistics that the plain layer
   gives on the whole batch in one process.
2. Then ``polyfhe.train`` of a tiny CPolyNeXt-BN (ChannelBatchNorm) into ``argv[1]``; the test trains the same in
   one process and compares the weights.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from polyfhe.data.sources import ImageDataset, load_digits
from polyfhe.models.layers.norms import ChannelBatchNorm, RunningRowSumNorm
from polyfhe.models.layers.token_norms import TokenBatchNorm
from polyfhe.training import train
from polyfhe.training.distributed import restore_batch_norms, setup, sync_batch_norms

CPOLYNEXT_TINY = {"channels": 8, "stacks": 1}
# SGD: see ATOL in test_distributed.py for why not AdamW
TRAIN = {"device": "cpu", "batch_size": 32, "epochs": 2, "progress": False, "ema_decay": 0.9, "optimizer": "sgd",
         "lr": 0.05, "model_kwargs": CPOLYNEXT_TINY}


def digits() -> ImageDataset:
    d = load_digits()
    return ImageDataset("digits", d.x_train[:320], d.y_train[:320], d.x_test[:96], d.y_test[:96], d.classes)


def layers() -> dict[str, tuple[torch.nn.Module, tuple[int, ...]]]:
    return {
        "TokenBatchNorm": (TokenBatchNorm(6), (8, 3, 5, 6)),
        "ChannelBatchNorm": (ChannelBatchNorm(4, (3, 5), bias=True), (8, 4, 3, 5)),
        "RunningRowSumNorm": (RunningRowSumNorm(2, 4), (8, 2, 4, 4)),
        "BatchNorm2d": (torch.nn.BatchNorm2d(4), (8, 4, 3, 5)),
    }


def check_layers(rank: int, world: int) -> dict[str, float]:
    """Largest difference per layer between this rank's synchronised share and the one-process whole batch."""
    worst = {}
    for name, (layer, shape) in layers().items():
        torch.manual_seed(1)
        x = torch.rand(shape) * 3 + 0.5  # row sums positive, as RunningRowSumNorm's inputs are
        weight = torch.randn(shape)
        with torch.no_grad():  # non-trivial affine parameters
            for p in layer.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        reference = _plain_step(layer, x, weight)
        holder = torch.nn.Sequential(layer)
        swaps = sync_batch_norms(holder)
        share = slice(rank * shape[0] // world, (rank + 1) * shape[0] // world)
        got = _plain_step(holder[0], x[share], weight[share], synced=True)
        restore_batch_norms(swaps)
        assert type(holder[0]) is type(layer)
        diffs = [float((got["y"] - reference["y"][share]).abs().max()),
                 float((got["x_grad"] - reference["x_grad"][share]).abs().max())]
        for key in reference:
            if key not in ("y", "x_grad"):
                diffs.append(float((got[key] - reference[key]).abs().max()))
        worst[name] = max(diffs)
    return worst


def _plain_step(layer: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor, synced: bool = False) -> dict:
    """One training forward/backward of ``(layer(x) * weight).sum()``. Synchronised, each rank sums its share;
    its parameter gradients summed over the ranks are those of the whole batch's sum."""
    import copy

    layer = copy.deepcopy(layer).train()
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y * weight).sum().backward()
    out = {"y": y.detach(), "x_grad": x.grad}
    for pname, p in layer.named_parameters():
        grad = p.grad.clone()
        if synced:
            dist.all_reduce(grad)
        out["grad." + pname] = grad
    for bname, b in layer.named_buffers():
        out["buffer." + bname] = b.float()
    return out


def main() -> int:
    out = sys.argv[1]
    ctx, _ = setup("cpu")  # torchrun's variables: opens the gloo group that train() then joins
    assert ctx.enabled and ctx.backend == "gloo"
    rank, world = ctx.rank, ctx.world_size
    worst = check_layers(rank, world)
    result = train("cpolynext_fhe_bn", digits(), TRAIN["epochs"], out, **{k: v for k, v in TRAIN.items()
                                                                            if k != "epochs"})
    if rank == 0:
        with open(f"{out}/worker.json", "w") as f:
            json.dump({"layers": worst, "world": world, "test_accuracy": result.metrics.test_accuracy}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
