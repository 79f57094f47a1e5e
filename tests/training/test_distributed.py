"""Data-parallel training (issue 41): two gloo processes on CPU train to the weights of one process with the same
global batch, through ``polyfhe train --nproc 2`` and through torchrun with ``polyfhe.train``; the synchronised
norms match the plain ones on the whole batch; the launcher's command line; rank-0-only files; resuming."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from polyfhe.cli import build_parser
from polyfhe.commands.train import launch_command, worker_argv
from polyfhe.data.sources import ImageDataset, load_digits
from polyfhe.models.layers.norms import ChannelBatchNorm
from polyfhe.training import train
from polyfhe.training.data import make_splits
from polyfhe.training.distributed import (
    SINGLE,
    DistContext,
    SyncChannelBatchNorm,
    launched_by_torchrun,
    restore_batch_norms,
    setup,
    sync_batch_norms,
)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ddp_worker.py")
SHARES_WORKER = Path(__file__).with_name("ddp_shares_worker.py")
MONET_TINY = ["--model-arg", "dims=[16]", "--model-arg", "depths=[1]"]
CLI_RUN = ["--model", "monet_lr_bn", "--data", "digits", "--train-subset", "256", "--epochs", "2",
           "--batch-size", "64", "--device", "cpu", "--no-progress", "--ema-decay", "0.9", "--optimizer", "sgd",
           "--lr", "0.05", *MONET_TINY]
# float32 sums in another order, a few steps. SGD, not AdamW: a bias right before a BatchNorm has a gradient of
# exactly 0 in exact arithmetic, and AdamW turns its rounding noise (1e-10) into steps of +-lr whose signs differ
# between any two summation orders; every other weight agrees to 1e-7 under AdamW too.
ATOL = 2e-5


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        if wa[key].is_floating_point():
            torch.testing.assert_close(wa[key], wb[key], atol=ATOL, rtol=1e-4, msg=key)
        else:
            assert torch.equal(wa[key], wb[key]), key


def _history(out: Path) -> list[dict]:
    return json.loads((out / "metrics.json").read_text())["history"]


@pytest.fixture(scope="module")
def digits_320() -> ImageDataset:
    d = load_digits()
    return ImageDataset("digits", d.x_train[:320], d.y_train[:320], d.x_test[:96], d.y_test[:96], d.classes)


def test_nproc_2_trains_to_the_weights_of_one_process(tmp_path: Path) -> None:
    """`polyfhe train --nproc 2` (torchrun, gloo): MONet-BN's TokenBatchNorm, EMA kept by rank 0, metrics reduced."""
    two, one = tmp_path / "two", tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "polyfhe", "train", "--nproc", "2", *CLI_RUN, "--out", str(two)],
                          env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("test accuracy") == 1  # one summary: rank 0's
    code = subprocess.run([sys.executable, "-m", "polyfhe", "train", *CLI_RUN, "--out", str(one)], env=_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert code.returncode == 0, code.stdout + code.stderr
    _assert_same_weights(two, one)
    _assert_same_weights(two / "last", one / "last")
    m2, m1 = (json.loads((d / "metrics.json").read_text()) for d in (two, one))
    assert (m2["processes"], m1["processes"]) == (2, 1) and m2["weights"] == m1["weights"]
    assert m2["test_accuracy"] == m1["test_accuracy"] and m2["steps"] == m1["steps"] == 2 * 4
    for r2, r1 in zip(m2["history"], m1["history"], strict=True):
        for key in ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_accuracy_ema"):
            assert r2[key] == pytest.approx(r1[key], abs=1e-5), key

    # resumable: the two-process run's last/ continues in one process (the same files as one process writes)
    resumed = train("monet_lr_bn", "digits", 3, tmp_path / "resumed", device="cpu", batch_size=64,
                    train_subset=256, progress=False, ema_decay=0.9, optimizer="sgd", lr=0.05, resume=str(two))
    assert resumed.metrics.epochs == 3 and resumed.metrics.history[:2] == tuple(
        type(resumed.metrics.history[0]).from_dict(r) for r in _history(two))


def test_torchrun_workers_match_one_process(tmp_path: Path, digits_320: ImageDataset) -> None:
    """torchrun running polyfhe.train: the synchronised norms layer by layer, then CPolyNeXt-BN's ChannelBatchNorm."""
    two = tmp_path / "two"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(WORKER), str(two)], env=_env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((two / "worker.json").read_text())
    assert report["world"] == 2 and set(report["layers"]) == {
        "TokenBatchNorm", "ChannelBatchNorm", "RunningRowSumNorm", "BatchNorm2d"}
    for name, diff in report["layers"].items():
        assert diff < 5e-5, name  # float32: E[x^2] - mean^2 from sums, against torch's own reductions

    sys.path.insert(0, str(WORKER.parent))
    try:
        import ddp_worker
    finally:
        sys.path.remove(str(WORKER.parent))
    cfg = {k: v for k, v in ddp_worker.TRAIN.items() if k != "epochs"}
    one = train("cpolynext_fhe_bn", digits_320, ddp_worker.TRAIN["epochs"], tmp_path / "one", **cfg)
    _assert_same_weights(two, tmp_path / "one")
    assert report["test_accuracy"] == one.metrics.test_accuracy
    assert not (two / "last").is_symlink() and (two / "last" / "train_state.pt").is_file()


def _check_shares(run: Path, expected_labels: set[int], batch: int, epochs: int) -> None:
    """Each rank's steps trained on its share only: per global batch the ranks' images are disjoint and as many as
    the batch, each rank takes batch / world of them, and per epoch the ranks together cover every training image
    exactly once (none is dropped: the split is a multiple of the batch)."""
    reports = [json.loads(p.read_text()) for p in sorted(run.glob("shares-*.json"))]
    world = reports[0]["world"]
    assert world == 2 and sorted(r["rank"] for r in reports) == list(range(world))
    steps_per_epoch = len(expected_labels) // batch
    assert len(expected_labels) % batch == 0
    for report in reports:
        assert len(report["steps"]) == epochs * steps_per_epoch, report["rank"]
        for step in report["steps"]:
            # the model received this rank's share, not the global batch
            assert step["rows"] == len(step["labels"]) == batch // world, (report["rank"], step["rows"])
    for epoch in range(epochs):
        seen: list[int] = []
        for step in range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch):
            shares = [set(r["steps"][step]["labels"]) for r in reports]
            assert not shares[0] & shares[1], f"step {step}: ranks trained on the same images"
            seen += [label for r in reports for label in r["steps"][step]["labels"]]
        assert len(seen) == len(set(seen)) and set(seen) == expected_labels, f"epoch {epoch}"


def test_each_rank_trains_on_its_share_of_the_batch(tmp_path: Path) -> None:
    """Counted, not inferred from the weights (replicating the global batch on every rank can train to the same
    weights): two gloo ranks, every training image labelled with a class of its own, the labels and rows of each
    rank's steps recorded. The worker's second run replaces the sharding with a non-distributed one (every rank
    takes the whole global batch); the same checks must reject it."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SHARES_WORKER), str(tmp_path)], env=_env(), capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    sys.path.insert(0, str(SHARES_WORKER.parent))
    try:
        import ddp_shares_worker as worker
    finally:
        sys.path.remove(str(SHARES_WORKER.parent))
    cfg = worker.TRAIN
    splits = make_splits(worker.unique_labels(), val_fraction=cfg["val_fraction"], seed=0, normalize=True)
    expected = set(splits.y_train.tolist())
    assert len(expected) == 288
    _check_shares(tmp_path / "split", expected, cfg["batch_size"], cfg["epochs"])
    with pytest.raises(AssertionError):  # the negative control: replicated batches are caught
        _check_shares(tmp_path / "replicated", expected, cfg["batch_size"], cfg["epochs"])
    # and not because that run failed: it trained every step, on the whole global batch per rank
    replicated = [json.loads(p.read_text()) for p in sorted((tmp_path / "replicated").glob("shares-*.json"))]
    assert [len(r["steps"]) for r in replicated] == [cfg["epochs"] * 9] * 2
    assert all(s["rows"] == cfg["batch_size"] for r in replicated for s in r["steps"])


# ------------------------------------------------------------------------------------------ in one process
def test_shares_cover_the_batch_in_order() -> None:
    for n, world in ((64, 2), (10, 3), (2, 4)):
        parts = [DistContext(rank, world, rank, "gloo").shard(n) for rank in range(world)]
        assert [i for p in parts for i in range(n)[p]] == list(range(n))
        assert max(p.stop - p.start for p in parts) - min(p.stop - p.start for p in parts) <= 1
    assert SINGLE.shard(7) == slice(0, 7) and not SINGLE.enabled and SINGLE.is_main


def test_alone_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert not launched_by_torchrun() and setup("cpu") == (SINGLE, None)
    t = torch.ones(2)
    assert SINGLE.all_reduce_sum(t) is t and SINGLE.broadcast({"a": 1}) == {"a": 1}


def test_synchronised_twins_share_tensors_and_keys() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 1), ChannelBatchNorm(4, (2, 2)), torch.nn.BatchNorm2d(4))
    keys = list(model.state_dict())
    swaps = sync_batch_norms(model)
    assert isinstance(model[1], SyncChannelBatchNorm) and len(swaps) == 2
    assert list(model.state_dict()) == keys  # checkpoints keep the plain model's names
    with torch.no_grad():
        model[1].gamma_c.fill_(3.0)
        model[2].running_mean.fill_(0.5)
    restore_batch_norms(swaps)
    assert type(model[1]) is ChannelBatchNorm and type(model[2]) is torch.nn.BatchNorm2d
    assert float(model[1].gamma_c.detach()[0]) == 3.0 and float(model[2].running_mean[0]) == 0.5


def test_launcher_runs_the_same_command_under_torchrun(tmp_path: Path) -> None:
    args = build_parser().parse_args(["-v", "train", "--nproc", "4", *CLI_RUN, "--out", str(tmp_path),
                                      "--lr", "0.002", "--threads", "1"])
    argv = worker_argv(args)
    assert "--nproc" not in argv and argv[:2] == ["-v", "train"]
    again = build_parser().parse_args(argv)
    for key, value in vars(args).items():
        if key not in ("nproc", "func"):
            assert getattr(again, key) == value, key
    command = launch_command(args)
    assert command[1:8] == ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    assert command[8:10] == ["-m", "polyfhe"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--batch-size", "63"], "must split evenly over 2 processes"),
    (["--device", "cuda:1"], "names one GPU"),
])
def test_launcher_refuses_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str],
                                          message: str) -> None:
    args = build_parser().parse_args(["train", "--nproc", "2", *CLI_RUN, *extra, "--out", str(tmp_path)])
    assert args.func(args) == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_batch_must_split_over_the_processes(tmp_path: Path, digits_320: ImageDataset,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from polyfhe.training import api

    monkeypatch.setattr(api, "setup", lambda device: (DistContext(0, 3, 0, "gloo"), torch.device("cpu")))
    monkeypatch.setattr(api, "teardown", lambda ctx: None)
    with pytest.raises(ValueError, match="batch_size 32 is the global batch and must split evenly over 3"):
        train("monet_lr_bn", digits_320, 1, tmp_path, device="cpu", batch_size=32, progress=False,
              model_kwargs={"dims": [16], "depths": [1]})
