"""The user-written polynomial attention network (``bench/user_models.py``) and its case in ``bench/ckks_plans.py``:
eval mode is a fixed polynomial (batch independent, degree 36, ct x ct depth 6), the running l1 constant is a
statistic of training only, and the bench makes the case and files a tree's refusal as a result."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ckks_testlib import bench_module


@pytest.fixture(scope="module")
def plans():
    """``bench/ckks_plans.py``, with bench/ on sys.path (so ``user_models`` imports as the bench imports it)."""
    with bench_module("ckks_plans") as module:
        yield module


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: these models are small, and on a loaded machine a second thread costs ten times more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(plans):
    import user_models

    return user_models


def settled(models, seed: int = 0):
    """A model whose BatchNorm and l1 statistics come from a few training-mode batches (weights untrained)."""
    torch.manual_seed(seed)
    model = models.UserAttentionBN()
    model.train()
    with torch.no_grad():
        for _ in range(10):
            model(torch.rand(32, 1, 28, 28))
    return model.eval()


def fashion_or_skip():
    from polyfhe.data.sources import load_dataset

    try:
        return load_dataset("fashion-mnist")
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(f"Fashion-MNIST is not installed: {exc}")


def test_shapes_and_no_polyfhe_in_the_model(models):
    model = models.UserAttentionBN()
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)
    assert len(model.blocks) == 2 and model.blocks[0].wq.weight.shape == (32, 32)
    assert model.blocks[0].w1.weight.shape == (64, 32) and model.blocks[0].w3.weight.shape == (32, 64)
    source = Path(models.__file__).read_text()
    assert "import polyfhe" not in source and "from polyfhe" not in source  # plain torch


def test_eval_forward_is_batch_independent_and_deterministic(models):
    model = settled(models).double()
    x = torch.rand(6, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        whole = model(x)
        again = model(x)
        one_by_one = torch.cat([model(x[i:i + 1]) for i in range(len(x))])
        reversed_batch = model(x.flip(0)).flip(0)
    assert torch.equal(whole, again)
    torch.testing.assert_close(one_by_one, whole, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(reversed_batch, whole, rtol=1e-10, atol=1e-10)


def test_running_l1_scale_updates_in_training_and_is_constant_in_eval(models):
    scale = models.RunningL1Scale()
    assert float(scale.running_denom) == 1.0
    a = torch.randn(4, 49, 49, requires_grad=True)
    stat = float(a.detach().abs().sum(-1).mean())
    out = scale.train()(a)
    torch.testing.assert_close(out, a / stat)  # training: the batch statistic
    assert float(scale.running_denom) == pytest.approx(0.9 * 1.0 + 0.1 * stat)  # EMA, momentum 0.1
    out.sum().backward()  # the statistic is detached: the gradient is 1 / stat everywhere
    torch.testing.assert_close(a.grad, torch.full_like(a, 1.0 / stat))
    scale.eval()
    frozen = float(scale.running_denom)
    b = 10 * torch.randn(2, 49, 49)
    torch.testing.assert_close(scale(b), b / frozen)  # eval: a constant, whatever the data
    assert float(scale.running_denom) == frozen
    assert "running_denom" in dict(scale.named_buffers())  # saved with the model's state


def test_onnx_export_is_polynomial_with_the_expected_degree(models, tmp_path):
    """Per block: Q K^T V is a product of three linear maps of x (degree x3, two ct x ct products), the Hadamard
    MLP one more product (degree x2): 6^2 = 36, depth 2 x 3 = 6. Levels: the embedding 1, then per block the
    Q K^T product, the division by the l1 constant, the product with V, Wo, the Hadamard product and W3 (6), the
    BatchNorms and the head merged into their neighbours: 1 + 2 x 6 = 13."""
    import polyfhe

    model = settled(models)
    path = polyfhe.export(model, target="onnx", path=tmp_path / "attention.onnx", input_shape=(1, 28, 28))
    report = polyfhe.analyze(path)
    assert report.polynomial and not report.violations
    assert (report.degree, report.mult_depth, report.levels) == (36, 6, 13)
    ops = report.to_dict()["op_counts"]
    assert ops["ct_ct_mults"] == 6 and "Softmax" not in ops["by_op"] and ops["by_op"]["Div"] == 2


def test_train_briefly_learns_and_keeps_the_l1_constants(models):
    torch.manual_seed(0)
    x = torch.rand(96, 1, 28, 28)
    y = (x.mean((1, 2, 3)) > x.mean()).long()  # a toy label
    model = models.train_briefly(models.UserAttentionBN(num_classes=2), x, y, epochs=2, batch=32)
    assert not model.training
    denoms = [float(b.scale.running_denom) for b in model.blocks]
    assert all(np.isfinite(d) and d != 1.0 for d in denoms)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()


def test_the_case_is_listed_with_targets(plans):
    assert "user_attention" in plans.CASES and "user_attention" in plans.__doc__
    assert plans.TARGETS["user_attention"]["per_image_s"][1] == 10.0
    assert plans.TARGETS["user_attention"]["server_rss_gb"] == plans.TARGETS["user_monet"]["server_rss_gb"]
    assert plans.case_label("user_attention") == "user_attention"


@pytest.mark.slow
def test_make_case_writes_a_model_better_than_chance(plans, tmp_path):
    data = fashion_or_skip()
    plans.make_case("user_attention", tmp_path, images=2)
    model = torch.load(tmp_path / "model.pt", weights_only=False)
    arrays = np.load(tmp_path / "data.npz")
    assert arrays["test"].shape == (2, 1, 28, 28) and arrays["calibration"].shape == (256, 1, 28, 28)
    assert not model.training
    with torch.no_grad():
        predicted = model(torch.from_numpy(data.x_test[:2000])).argmax(1).numpy()
    assert np.mean(predicted == data.y_test[:2000]) > 0.3  # chance is 0.1


def test_make_case_takes_a_model_file(plans, models, tmp_path):
    fashion_or_skip()
    model = settled(models)
    torch.save(model, tmp_path / "trained.pt")
    plans.make_case("user_attention", tmp_path / "case", images=3, model_file=tmp_path / "trained.pt")
    loaded = torch.load(tmp_path / "case" / "model.pt", weights_only=False)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert np.load(tmp_path / "case" / "data.npz")["test"].shape == (3, 1, 28, 28)


def test_model_file_specs(plans, tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    assert plans.parse_model_files([str(path)], ["user_attention"]) == {"user_attention": path}
    assert plans.parse_model_files([f"user_attention={path}"], ["user_monet", "user_attention"]) == {
        "user_attention": path}
    with pytest.raises(ValueError, match="name its case"):
        plans.parse_model_files([str(path)], ["user_monet", "user_attention"])
    with pytest.raises(ValueError, match="not run"):
        plans.parse_model_files([f"digits_mlp={path}"], ["user_attention"])
    with pytest.raises(ValueError, match="no file"):
        plans.parse_model_files([f"user_attention={tmp_path / 'missing.pt'}"], ["user_attention"])


class CKKSExportError(ValueError):
    """Stands in for the compiler's refusals (ValueErrors), whose module another change may be rewriting."""


def test_a_compile_refusal_is_a_result_and_a_crash_an_error(plans):
    refused = plans.stage_failure("compile", CKKSExportError("MatMul of two encrypted 49x49 operands\nmore"))
    assert refused == {"failed": {"message": "CKKSExportError: MatMul of two encrypted 49x49 operands",
                                  "refusal": True}}
    assert not plans.stage_failure("compile", MemoryError())["failed"]["refusal"]
    assert not plans.stage_failure("server", ValueError("bad query"))["failed"]["refusal"]


def test_a_failed_stage_reports_its_error(plans, tmp_path):
    """A stage that raises reports its error's type and first line; one that is no refusal stays an error."""
    with pytest.raises(plans.StageFailed) as info:
        plans._run_stage(["compile", str(tmp_path / "missing"), str(tmp_path / "prog")], plans.tree_env(None))
    assert "FileNotFoundError" in str(info.value) and info.value.refusal is None


def test_the_table_shows_a_refusal(plans):
    info = {"cpu": "cpu", "usable_cores": 2, "load_avg_1m": 0.0, "python": "3.11", "baseline": "main~"}
    rows = [{"case": "user_attention", "column": "this tree / seal", "tree": "this", "compile_s": 12.0,
             "per_image_s": 4.0, "server_rss_gb": 2.0, "argmax_agreement": 1.0},
            {"case": "user_attention", "column": "baseline / seal", "tree": "baseline",
             "refused": "LoweringError: MatMul of two encrypted operands | 49x49x32"}]
    table = plans.render(info, rows)
    status = next(line for line in table.splitlines() if line.startswith("| compiled |"))
    assert "| yes | refused: LoweringError: MatMul of two encrypted operands \\| 49x49x32 |" in status
    assert "error (" not in table
    assert "target time per image s <= 10.0: 4 met" in table
    assert "target argmax agreement >= 1.0: 1 met" in table
