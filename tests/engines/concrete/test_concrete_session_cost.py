"""A real Concrete ML client's evaluation keys against what polyfhe's server side knows before it parses them: the
walk of the key set, the upload bound, the memory a session's worker takes, and a corrupt key set refused over
HTTP while another session keeps working. Marked ``concrete`` (real Concrete ML, ``polyfhe setup concrete``)."""

from __future__ import annotations

import json
import struct
import zipfile

import pytest
import torch
from ckks_testlib import Square, digits, train
from test_concrete_keyset import write_keyset
from torch import nn

from polyfhe.engines.concrete.keyset import check_evaluation_keys
from polyfhe.procinfo import proc_bytes
from polyfhe.program.engines import decoded_context_bytes, max_context_bytes
from polyfhe.program.wire import KIND_CONTEXT, WireError, pack, unpack

pytestmark = pytest.mark.concrete


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    from polyfhe.exporters.concrete import export_concrete

    torch.manual_seed(0)
    mlp = train(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), Square(), nn.Linear(16, 10)), epochs=20)
    x, _, _, _ = digits()
    folder = tmp_path_factory.mktemp("cost")
    prog = export_concrete(mlp, x[:200], n_bits=4, rounding_threshold_bits=6, out=folder)
    prog.save(folder)
    return prog


@pytest.fixture(scope="module")
def client(program):
    client = program.client()
    yield client
    client.close()


def _keys(context: bytes) -> bytes:
    return bytes(unpack(context, KIND_CONTEXT).sections["evaluation_keys"])


def _first_segment(keys: bytes) -> tuple[int, int]:
    """(byte offset, words) of a serialised key set's first segment."""
    count = struct.unpack_from("<I", keys, 0)[0] + 1
    table = 4 * (1 + count)
    return table + (-table % 8), struct.unpack_from("<I", keys, 4)[0]


def test_real_keys_are_laid_out_as_the_walk_expects(program, client):
    keys = _keys(client.public_context())
    check_evaluation_keys(keys, program.keyset())
    # the first segment (the key set's structure, everything but the payloads) word for word as the tests'
    # writer lays it out from the client specs: their tables of concrete-protocol's layout are Concrete's own
    with zipfile.ZipFile(program.directory / "client.zip") as archive:
        keyset = json.loads(archive.read("client.specs.json"))["keyset"]
    _, writer = write_keyset(keyset, payload_words=[k.payload_words for k in program.keyset()])
    offset, size = _first_segment(keys)
    real = struct.unpack_from(f"<{size}Q", keys, offset)
    far = {start for name, (_, start) in writer.where.items() if name.endswith(".blobs")}  # segments differ
    assert size == len(writer.segs[0])
    assert [w for i, w in enumerate(real) if i not in far] == [w for i, w in enumerate(writer.segs[0]) if i not in far]


def test_upload_bound_holds_a_real_client_and_little_more(program, client):
    context = client.public_context()
    bound = max_context_bytes(program)
    assert bound is not None and len(context) <= bound <= len(context) + 4096, (len(context), bound)


def test_budget_counts_the_session_worker_measured(program, client):
    """What the server's budget counts for a session covers the keys the server holds and its worker's peak
    resident memory through loading the keys and a first query, without counting it twice over."""
    context = client.public_context()
    server = program.server(context)
    try:
        _, _, xt, _ = digits()
        server.run(client.encrypt(xt[0]))
        peak = proc_bytes(f"/proc/{server._worker._proc.pid}/status", "VmHWM")
    finally:
        server.close()
    counted = decoded_context_bytes(program, len(context))
    held = len(context) + peak
    assert held <= counted <= 1.25 * held, (counted, held)


def test_corrupt_keys_are_refused_over_http_while_another_session_keeps_working(program, client, tmp_path):
    import httpx

    from tests.serve.serve_testlib import start_server

    program.save(tmp_path / "programs" / "tfhe")
    server = start_server(tmp_path / "programs", tmp_path / "server.log", "--key-budget-mb", "16000")
    try:
        url = f"{server.url}/v1/sessions?model=tfhe"
        context = client.public_context()
        good = httpx.post(url, content=context, timeout=300)
        assert good.status_code == 201, good.text
        keys = bytearray(_keys(context))
        offset, _ = _first_segment(bytes(keys))
        keys[offset + 15 * 8 + 4] ^= 1  # the first bootstrap key's polynomial size (its parameters start at word 14)
        header = unpack(context, KIND_CONTEXT).header
        corrupt = pack(KIND_CONTEXT, header, {"evaluation_keys": bytes(keys)})
        refused = httpx.post(url, content=corrupt, timeout=300)
        assert refused.status_code == 400 and "not a key set for this program" in refused.text, refused.text
        truncated = pack(KIND_CONTEXT, header, {"evaluation_keys": bytes(keys[:-4096])})
        assert httpx.post(url, content=truncated, timeout=300).status_code == 400
        _, _, xt, _ = digits()
        answer = httpx.post(f"{server.url}/v1/sessions/{good.json()['session_id']}/infer",
                            content=client.encrypt(xt[1]), timeout=300)
        assert answer.status_code == 200, answer.text
        assert client.decrypt(answer.content).shape == (1, 10)
    finally:
        server.stop()
    with pytest.raises(WireError, match="polynomial size|parameters of bootstrap key 0"):
        program.server(corrupt)
