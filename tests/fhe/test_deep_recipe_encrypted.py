"""The deep FHE recipe (``monet_fhe_deep_bn``: six Poly-Blocks, 25 levels) trained briefly and run encrypted with
128-bit bootstrapping on Lattigo. Width 32 instead of the recipe's 64: the same depth and bootstraps with a
quarter of the plaintext diagonals, so client and server fit one test process beside CI's other work (the full
width runs in ``bench/ckks.py --model ... --backend lattigo``, measured in docs/ckks.md)."""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest
import torch

import polyfhe
from polyfhe.data.sources import load_dataset
from polyfhe.export.ckks import export_ckks

log = logging.getLogger(__name__)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # training a few minutes, key generation 1-2 min, about 2-4 min per image
def test_deep_recipe_runs_encrypted_with_bootstraps_and_agrees_with_torch(tmp_path):
    data = load_dataset("fashion-mnist")
    result = polyfhe.train("monet_fhe_deep_bn", "fashion-mnist", epochs=4, out_dir=tmp_path / "run", device="cpu",
                           train_subset=12000, batch_size=128, lr=2e-3, augment="none", progress=False, seed=0,
                           model_kwargs={"dims": (32,)})
    model = result.normalization.prepend_to(result.model).eval()  # takes images in [0, 1], as exported
    x = data.x_test[:2].astype(np.float32)
    prog = export_ckks(model, calibration=data.x_train[:64], input_shape=(1, 28, 28), backend="lattigo")
    boot = prog.manifest.info["bootstrap"]
    assert prog.params.security == "tc128" and boot["spec"]["logn"] == 16
    assert len(boot["cuts_after_level"]) >= 3 and boot["count"] >= 3
    with torch.no_grad():
        ref = model.double()(torch.from_numpy(x.astype(np.float64))).numpy()
    np.testing.assert_allclose(prog.run_plain(x), ref, rtol=1e-4, atol=1e-4)
    client = prog.client()
    context_file = tmp_path / "context.bin"  # public keys only (about 5.6 GB): the server maps it, as a real one
    context_file.write_bytes(client.public_context())  # would read an upload spooled to disk
    client.release_public_context()
    with open(context_file, "rb") as f:
        server = prog.server(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    lanes = prog.manifest.samples_per_ciphertext
    out = np.concatenate([client.decrypt(server.run(client.encrypt(x[i:i + lanes])))[: len(x[i:i + lanes])]
                          for i in range(0, len(x), lanes)])
    err = float(np.abs(out - ref).max())
    log.info("monet_fhe_deep_bn encrypted: %d bootstraps, max logit error %.3g (largest logit %.3g)",
             boot["count"], err, np.abs(ref).max())
    assert np.array_equal(out.argmax(1), ref.argmax(1))
    assert err < 0.05 * max(1.0, float(np.abs(ref).max()))
