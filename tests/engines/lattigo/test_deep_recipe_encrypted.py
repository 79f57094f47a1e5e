"""The deep FHE recipe (``monet_fhe_deep_bn``: six Poly-Blocks, 25 levels) trained briefly, then (1) its 128-bit
bootstrapping export refused on a 24 GiB machine, and (2) run encrypted with bootstraps on Lattigo at an
explicitly INSECURE small ring, with packed bootstraps (a cut's registers sharing one).

(1) 128-bit bootstrapping runs on N=2^16 only (``polyfhe/engines/lattigo/bootsecurity.py``: ring switching from a smaller residual ring
puts the residual secret on the whole bootstrapping modulus, which is not 128-bit secure), and its key generation
peaks near 24 GB or more: past the default budget of CI's 24 GiB machine (75% of its memory). The export must say
so, with the memory it needs and the setting (``bootstrap_memory=`` / ``--bootstrap-memory``) that plans for a
larger machine, rather than be skipped.

(2) The encrypted run uses ``security="none"`` parameters: a ``[60, 40 x 7, 60]`` chain on N=2^14 that bootstraps
on its own ring. It is NOT 128-bit secure (its bootstrapping keys hold about 1,530 bits of modulus at N=2^14;
tests only), and exercises everything else a 128-bit program does: bootstrap placement, calibrated ranges, the
bootstrapping keys made in their child process and Lattigo's bootstrapper, on the trained deep recipe. Width 32
instead of the recipe's 64: the same depth with a quarter of the plaintext diagonals, so client and server fit one
test process beside CI's other work.
"""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest
import torch

import polyfhe
from polyfhe.data.sources import load_dataset
from polyfhe.engines.lattigo.bootcircuit import BOOTSTRAP_RING
from polyfhe.engines.lattigo.bootsecurity import check_bootstrap_security
from polyfhe.exporters.ckks import CKKSExportError, export_ckks
from polyfhe.program.bootstrapping import BootstrapSpec
from polyfhe.program.params import CKKSParams

log = logging.getLogger(__name__)

# the default bootstrapping budget of CI's machine: 75% of its 24 GiB (``machine_memory_budget``)
CI_MACHINE_BUDGET = int(0.75 * 24 * 2**30)
# INSECURE on purpose (security="none"): 7 levels between bootstraps, bootstrapping on N=2^14 itself
INSECURE_RING = CKKSParams(1 << 14, (60, *(40,) * 7, 60), 40, security="none")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # training a few minutes, export and key generation about a minute, then each image
def test_deep_recipe_refuses_128_bit_here_and_runs_encrypted_with_bootstraps_on_an_insecure_ring(tmp_path):
    data = load_dataset("fashion-mnist")
    result = polyfhe.train("monet_fhe_deep_bn", "fashion-mnist", epochs=4, out_dir=tmp_path / "run", device="cpu",
                           train_subset=12000, batch_size=128, lr=2e-3, augment="none", progress=False, seed=0,
                           model_kwargs={"dims": (32,)})
    model = result.normalization.prepend_to(result.model).eval()  # takes images in [0, 1], as exported
    calibration = data.x_train[:64]

    # (1) 128-bit: refused within a 24 GiB machine's budget, saying what it needs and what to change
    with pytest.raises(CKKSExportError) as refused:
        export_ckks(model, calibration=calibration, input_shape=(1, 28, 28), backend="lattigo",
                    bootstrap_memory=CI_MACHINE_BUDGET)
    message = str(refused.value)
    assert f"cannot bootstrap within {CI_MACHINE_BUDGET / 1e9:.1f} GB" in message
    assert f"residual N={BOOTSTRAP_RING}" in message and "--bootstrap-memory" in message
    need_gb = int(message.split("run it on a machine with at least ")[1].split(" GB")[0])
    assert need_gb * 1e9 > CI_MACHINE_BUDGET
    log.info("monet_fhe_deep_bn at 128 bits refused here: %s", message)

    # (2) encrypted with bootstraps at the INSECURE small ring
    x = data.x_test[:2].astype(np.float32)
    prog = export_ckks(model, calibration=calibration, input_shape=(1, 28, 28), backend="lattigo",
                       params=INSECURE_RING, allow_insecure=True)
    boot = prog.manifest.info["bootstrap"]
    assert prog.params.security == "none" and prog.params.poly_modulus_degree == 1 << 14
    assert boot["spec"]["logn"] == 14  # its own ring: no ring switching
    assert not check_bootstrap_security(prog.params, BootstrapSpec.from_dict(boot["spec"])).secure
    assert len(boot["cuts_after_level"]) >= 3 and boot["count"] >= 3
    # a block's product and residual stream share one bootstrap at some cut (``pack.py``), checked encrypted below
    assert any(boot["packed"]) and any(len(s.inputs) > 1 for s in prog.manifest.steps if s.op == "bootstrap")
    with torch.no_grad():
        ref = model.double()(torch.from_numpy(x.astype(np.float64))).numpy()
    np.testing.assert_allclose(prog.run_plain(x), ref, rtol=1e-4, atol=1e-4)
    client = prog.client()
    context_file = tmp_path / "context.bin"  # public keys only: the server maps it, as a real one
    context_file.write_bytes(client.public_context())  # would read an upload spooled to disk
    client.release_public_context()
    with open(context_file, "rb") as f:
        server = prog.server(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    lanes = prog.manifest.samples_per_ciphertext
    out = np.concatenate([client.decrypt(server.run(client.encrypt(x[i:i + lanes])))[: len(x[i:i + lanes])]
                          for i in range(0, len(x), lanes)])
    err = float(np.abs(out - ref).max())
    log.info("monet_fhe_deep_bn encrypted (INSECURE N=2^14): %d bootstraps of %d slots (packed cuts %s), max logit "
             "error %.3g (largest logit %.3g)", boot["count"], boot["slots"], boot["packed"], err, np.abs(ref).max())
    assert np.array_equal(out.argmax(1), ref.argmax(1))
    assert err < 0.05 * max(1.0, float(np.abs(ref).max()))
