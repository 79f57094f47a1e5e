"""`polyfhe run` and `polyfhe client keys create --program` refuse insecure programs unless --allow-insecure."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from polyfhe.cli import main
from polyfhe.program.ckks_program import load_program
from polyfhe.program.params import CKKSParams, InsecureParametersError, require_secure

pytestmark = pytest.mark.fhe


class Square(nn.Module):
    def forward(self, x):
        return x * x


@pytest.fixture(scope="module")
def insecure(tmp_path_factory) -> dict:
    """A tiny program exported on N=4096 with an insecure chain (security "none"), and an input."""
    import polyfhe

    root = tmp_path_factory.mktemp("insecure")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), Square(), nn.Linear(4, 2)).eval()
    calib = np.random.default_rng(0).random((32, 1, 4, 4)).astype(np.float32)
    np.save(root / "x.npy", calib[:1])
    params = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
    polyfhe.export(model, target="ckks", calibration=calib, input_shape=(1, 4, 4), params=params,
                   allow_insecure=True).save(root / "prog")
    assert load_program(root / "prog").params.security == "none"
    return {"prog": root / "prog", "x": root / "x.npy", "root": root}


def test_require_secure_is_one_library_check():
    secure = CKKSParams(8192, (60, 40, 60), 40)
    weak = CKKSParams(4096, (60, 40, 40, 40, 60), 40, security="none")
    require_secure(secure, False, "run")
    require_secure(weak, True, "run")
    with pytest.raises(InsecureParametersError, match="refusing to serve .* pass --allow-insecure") as info:
        require_secure(weak, False, "serve")
    assert isinstance(info.value, ValueError)


def test_run_refuses_an_insecure_program_without_the_flag(insecure, capsys):
    assert main(["run", str(insecure["prog"]), "--input", str(insecure["x"])]) == 2
    err = capsys.readouterr().err
    assert "insecure CKKS parameters" in err and "security none" in err and "--allow-insecure" in err
    assert main(["run", str(insecure["prog"]), "--input", str(insecure["x"]), "--allow-insecure", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_abs_error"] < 1e-2


def test_keys_create_refuses_an_insecure_program_without_the_flag(insecure, capsys):
    keys = insecure["root"] / "keys"
    assert main(["client", "keys", "create", "--program", str(insecure["prog"]), "--out", str(keys)]) == 2
    err = capsys.readouterr().err
    assert "refusing to create keys for" in err and "--allow-insecure" in err
    assert not (keys / "secret.pfhe").exists()
    assert main(["client", "keys", "create", "--program", str(insecure["prog"]), "--out", str(keys),
                 "--allow-insecure"]) == 0
    assert (keys / "secret.pfhe").exists()
