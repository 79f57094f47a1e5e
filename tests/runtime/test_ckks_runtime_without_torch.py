"""The CKKS runtime (program, client, server) must run where neither torch nor onnx is installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from ckks_testlib import digits, digits_mlp

from polyfhe.exporters.ckks import export_ckks

pytestmark = pytest.mark.fhe


def test_saved_program_runs_with_torch_and_onnx_blocked(tmp_path):
    _, _, x, _ = digits()
    model = digits_mlp()
    prog = export_ckks(model, calibration=x[:64], input_shape=(1, 8, 8))
    prog.save(tmp_path / "prog")
    np.save(tmp_path / "x.npy", x[:2])
    expected = prog.run_plain(x[:2])
    script = textwrap.dedent(f"""
        import sys
        for blocked in ("torch", "onnx", "onnxruntime"):
            sys.modules[blocked] = None  # any import of them now raises ImportError
        import numpy as np
        import polyfhe
        prog = polyfhe.load_program({str(tmp_path / "prog")!r})
        client = prog.client()
        server = prog.server(client.public_context())
        x = np.load({str(tmp_path / "x.npy")!r})
        out = np.concatenate([client.decrypt(server.run(client.encrypt(row))) for row in x])
        np.save({str(tmp_path / "out.npy")!r}, out)
        assert not any(m in sys.modules and sys.modules[m] is not None for m in ("torch", "onnx"))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    out = np.load(tmp_path / "out.npy")
    assert np.array_equal(out.argmax(1), expected.argmax(1))
    assert np.abs(out - expected).max() < 1e-3
