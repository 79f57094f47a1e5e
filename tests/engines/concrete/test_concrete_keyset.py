"""Concrete ML evaluation keys walked before Concrete parses them (polyfhe.engines.concrete.keyset), and what a
Concrete server session costs: the upload bound and the memory the server's key budget counts. No Concrete ML
needed: key sets are written here the way Concrete's client lays them out (one Cap'n Proto ServerKeyset, payload
blobs in segments of their own behind far pointers), for a small key set described by its client specs."""

from __future__ import annotations

import json
import struct
import sys
import zipfile
from pathlib import Path

import pytest

from polyfhe.engines.concrete import ConcreteProgram
from polyfhe.engines.concrete.env import ConcreteEnv
from polyfhe.engines.concrete.keyset import BLOB_BYTES, blob_lengths, check_evaluation_keys, keyset_from_specs
from polyfhe.engines.concrete.program import ConcreteServer
from polyfhe.program.wire import KIND_CONTEXT, WireError, pack

NATIVE = {"modulus": {"native": {}}}


def _bsk(i, n_in, level, k, n, compression):
    return {"id": i, "inputId": 2 * i + 1, "outputId": 2 * i, "compression": compression,
            "params": {"levelCount": level, "baseLog": 15, "glweDimension": k, "polynomialSize": n,
                       "variance": 2.0 ** -124, "integerPrecision": 64, "modulus": NATIVE, "keyType": "binary",
                       "inputLweDimension": n_in}}


def _ksk(i, n_in, level, n_out, compression, modulus=NATIVE):
    return {"id": i, "inputId": 0, "outputId": i + 1, "compression": compression,
            "params": {"levelCount": level, "baseLog": 3, "variance": 8.442253112932959e-31, "integerPrecision": 64,
                       "modulus": modulus, "keyType": "binary", "inputLweDimension": n_in,
                       "outputLweDimension": n_out}}


KEYSET = {
    "lweSecretKeys": [],
    "lweBootstrapKeys": [_bsk(0, 4, 1, 1, 8, "seed"), _bsk(1, 3, 2, 2, 4, "none")],
    "lweKeyswitchKeys": [_ksk(0, 8, 2, 4, "seed"), _ksk(1, 8, 1, 3, "none", {"modulus": {"powerOfTwo": {"power": 60}}})],
    "packingKeyswitchKeys": [{"id": 0, "inputId": 1, "outputId": 0, "compression": "none",
                              "params": {"levelCount": 1, "baseLog": 20, "glweDimension": 1, "polynomialSize": 4,
                                         "inputLweDimension": 4, "innerLweDimension": 4, "variance": 1e-20,
                                         "integerPrecision": 64, "modulus": NATIVE, "keyType": "binary"}}],
}
# payload words by concrete-cpu's sizes: seeded bootstrap n_in*l*(k+1)*N + 2 (the seed), full n_in*l*(k+1)^2*N;
# seeded keyswitch n_in*l + 2, full n_in*l*(n_out+1); packing keyswitch (n_in+1)*l*(k+1)*N*(k+1)
PAYLOAD_WORDS = [4 * 1 * 2 * 8 + 2, 3 * 2 * 9 * 4, 8 * 2 + 2, 8 * 1 * 4, 5 * 1 * 2 * 4 * 2]


def _fields(values: dict, layout, words: int) -> list[int]:
    out = [0] * words
    for name, offset, bits in layout:
        value = values[name]
        raw = struct.unpack("<Q", struct.pack("<d", value))[0] if bits == "f64" else int(value)
        out[offset // 64] |= raw << (offset % 64)
    return out


# concrete-protocol's data sections (checked against a real client's keys in test_concrete_session_cost.py)
INFO = (("id", 0, 32), ("inputId", 32, 32), ("outputId", 64, 32), ("compression", 96, 16))
PARAMS = {
    "lweBootstrapKeys": (5, (("levelCount", 0, 32), ("baseLog", 32, 32), ("glweDimension", 64, 32),
                             ("polynomialSize", 96, 32), ("variance", 128, "f64"), ("integerPrecision", 192, 32),
                             ("keyType", 224, 16), ("inputLweDimension", 256, 32))),
    "lweKeyswitchKeys": (4, (("levelCount", 0, 32), ("baseLog", 32, 32), ("variance", 64, "f64"),
                             ("integerPrecision", 128, 32), ("keyType", 160, 16), ("inputLweDimension", 192, 32),
                             ("outputLweDimension", 224, 32))),
    "packingKeyswitchKeys": (5, (("levelCount", 0, 32), ("baseLog", 32, 32), ("glweDimension", 64, 32),
                                 ("polynomialSize", 96, 32), ("inputLweDimension", 128, 32),
                                 ("innerLweDimension", 160, 32), ("variance", 192, "f64"),
                                 ("integerPrecision", 256, 32), ("keyType", 288, 16))),
}


class KeysetWriter:
    """Writes a ServerKeyset message word by word; ``where`` remembers each object's (segment, first word)."""

    def __init__(self) -> None:
        self.segs: list[list[int]] = [[]]
        self.where: dict[str, tuple[int, int]] = {}

    def alloc(self, seg: int, words: int) -> int:
        while len(self.segs) <= seg:
            self.segs.append([])
        start = len(self.segs[seg])
        self.segs[seg].extend([0] * words)
        return start

    def near(self, seg: int, at: int, kind: int, target: int, high: int) -> None:
        self.segs[seg][at] = kind | (((target - at - 1) & ((1 << 30) - 1)) << 2) | (high << 32)

    def struct(self, seg: int, at: int, data: list[int], pointers: int, name: str) -> int:
        start = self.alloc(seg, len(data) + pointers)
        self.segs[seg][start:start + len(data)] = data
        # an empty struct points one word back (offset -1), as Cap'n Proto writes it: offset 0 would be null
        self.near(seg, at, 0, start if data or pointers else at, len(data) | pointers << 16)
        self.where[name] = (seg, start)
        return start

    def blob(self, seg: int, at: int, nbytes: int, far_to: int | None) -> None:
        target = seg if far_to is None else far_to
        if far_to is not None:  # Concrete's blobs sit in segments of their own, behind a landing pad
            pad = self.alloc(target, 1)
            self.segs[seg][at] = 2 | (pad << 3) | (target << 32)
            seg, at = target, pad
        start = self.alloc(seg, -(-nbytes // 8))
        self.near(seg, at, 1, start, 2 | nbytes << 3)

    def key(self, seg: int, at: int, field: str, spec: dict, blobs: list[int], far_to: int | None, i: int) -> None:
        info = dict(spec, compression={"none": 0, "seed": 1}[spec["compression"]])
        istart = self.struct(seg, at, _fields(info, INFO, 2), 1, f"{field}[{i}].info")
        words, layout = PARAMS[field]
        params = dict(spec["params"], keyType=0)
        pstart = self.struct(seg, istart + 2, _fields(params, layout, words), 1, f"{field}[{i}].params")
        (member, body), = spec["params"]["modulus"]["modulus"].items()
        tag = {"native": 0, "powerOfTwo": 1, "integer": 2}[member]
        mstart = self.struct(seg, pstart + words, [tag], 1, f"{field}[{i}].modulus")
        self.struct(seg, mstart + 1, [] if member == "native" else [next(iter(body.values()))], 0, "member")
        ystart = self.struct(seg, at + 1, [], 1, f"{field}[{i}].payload")
        lstart = self.alloc(seg, len(blobs))
        self.near(seg, ystart, 1, lstart, 6 | len(blobs) << 3)
        self.where[f"{field}[{i}].blobs"] = (seg, lstart)
        for b, nbytes in enumerate(blobs):
            self.blob(seg, lstart + b, nbytes, far_to)

    def to_bytes(self) -> bytes:
        table = struct.pack(f"<{len(self.segs) + 1}I", len(self.segs) - 1, *map(len, self.segs))
        table += b"\0" * (-len(table) % 8)
        return table + b"".join(struct.pack(f"<{len(s)}Q", *s) for s in self.segs)


def write_keyset(keyset: dict = KEYSET, far: bool = True, payload_words: list[int] | None = None,
                 blobs: dict[int, list[int]] | None = None) -> tuple[bytes, KeysetWriter]:
    """A key set for ``keyset`` laid out as Concrete's client writes it; ``blobs``: key index -> blob lengths to
    write instead of Concrete's."""
    w = KeysetWriter()
    w.alloc(0, 1)
    root = w.struct(0, 0, [], 3, "root")
    index = 0
    for slot, field in enumerate(("lweBootstrapKeys", "lweKeyswitchKeys", "packingKeyswitchKeys")):
        specs = keyset[field]
        tag = w.alloc(0, 1 + 2 * len(specs))
        w.near(0, root + slot, 1, tag, 7 | (2 * len(specs)) << 3)
        w.segs[0][tag] = (len(specs) << 2) | (2 << 48)
        for i, spec in enumerate(specs):
            words = (payload_words or PAYLOAD_WORDS)[index]
            lengths = (blobs or {}).get(index, blob_lengths(words))
            w.key(0, tag + 1 + 2 * i, field, spec, lengths, len(w.segs) if far else None, i)
            index += 1
    return w.to_bytes(), w


def _program(folder: Path, keyset: dict = KEYSET) -> ConcreteProgram:
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / "client.zip", "w") as archive:
        archive.writestr("client.specs.json", json.dumps({"keyset": keyset, "circuits": []}))
    for name in ("server.zip", "model.onnx"):
        (folder / name).write_bytes(name.encode() * 10)
    return ConcreteProgram.create(folder, (1, 1, 8, 8), 10, {"n_bits": 4, "rounding_threshold_bits": 6,
                                                             "p_error": None}, "post-training",
                                  {"concrete_ml": "1.9.0"}, {"model_name": "fake"})


KEYS = keyset_from_specs({"keyset": KEYSET})


@pytest.mark.parametrize("far", [True, False])
def test_a_key_set_laid_out_as_concrete_writes_it_passes(far):
    data, _ = write_keyset(far=far)
    check_evaluation_keys(data, KEYS)
    assert [k.payload_words for k in KEYS] == PAYLOAD_WORDS


def test_payload_blobs_are_the_ones_concrete_writes():
    per = BLOB_BYTES // 8
    assert blob_lengths(10) == [80]
    assert blob_lengths(2 * per + 5) == [BLOB_BYTES, BLOB_BYTES, 40]


TWINS = dict(KEYSET, lweKeyswitchKeys=[_ksk(0, 8, 2, 4, "seed"), _ksk(1, 8, 2, 4, "seed")])


def _tampered(name: str) -> tuple[bytes, dict]:
    """One way each of a key set being wrong, and the key set it was meant for."""
    if name == "shared blob":  # two keys' payloads lead to one blob (amplification): their far pointers are equal
        _, w = write_keyset(TWINS, payload_words=[*PAYLOAD_WORDS[:3], 18, PAYLOAD_WORDS[4]])
        seg, start = w.where["lweKeyswitchKeys[0].blobs"]
        other_seg, other = w.where["lweKeyswitchKeys[1].blobs"]
        w.segs[other_seg][other] = w.segs[seg][start]
        return w.to_bytes(), TWINS
    return _tampered_bytes(name), KEYSET


def _tampered_bytes(name: str) -> bytes:
    if name == "short blobs":  # Concrete would copy blob 1 to 1 x BLOB_BYTES into a 66-word buffer
        return write_keyset(blobs={0: [264, 264]})[0]
    if name == "short payload":
        return write_keyset(payload_words=[65, *PAYLOAD_WORDS[1:]])[0]
    if name == "long payload":
        return write_keyset(payload_words=[*PAYLOAD_WORDS[:2], 19, *PAYLOAD_WORDS[3:]])[0]
    if name == "missing key":
        return write_keyset(dict(KEYSET, lweKeyswitchKeys=KEYSET["lweKeyswitchKeys"][:1]),
                            payload_words=PAYLOAD_WORDS[:3] + PAYLOAD_WORDS[4:])[0]
    data, w = write_keyset()
    words = [list(s) for s in w.segs]
    if name == "polynomial size":
        seg, start = w.where["lweBootstrapKeys[0].params"]
        words[seg][start + 1] += 1 << 32
    elif name == "key ids":
        seg, start = w.where["lweKeyswitchKeys[1].info"]
        words[seg][start] += 1
    elif name == "modulus":
        seg, start = w.where["lweKeyswitchKeys[1].modulus"]
        words[seg][start] = 0
    elif name == "variance":
        seg, start = w.where["lweBootstrapKeys[0].params"]
        words[seg][start + 2] ^= 1 << 60
    elif name == "capability":
        seg, start = w.where["lweBootstrapKeys[1].blobs"]
        words[seg][start] = 3
    elif name == "far into nowhere":
        seg, start = w.where["lweBootstrapKeys[1].blobs"]
        words[seg][start] = 2 | (99 << 32)
    elif name == "slack":
        words.append([0] * 4)
    w.segs = words
    out = w.to_bytes()
    if name == "truncated":
        return data[:-8]
    if name == "trailing":
        return data + b"\0" * 8
    if name == "too many segments":  # the same words cut into 100 segments: within the byte bound, not the count
        flat = [x for seg in words for x in seg]
        w.segs = [flat[i::100] for i in range(100)]
        return w.to_bytes()
    return out


TAMPERED = ["short blobs", "short payload", "long payload", "missing key", "polynomial size", "key ids", "modulus",
            "variance", "shared blob", "capability", "far into nowhere", "slack", "truncated", "trailing",
            "too many segments"]


@pytest.mark.parametrize("name", TAMPERED)
def test_a_key_set_that_differs_is_refused_naming_what(name):
    data, keyset = _tampered(name)
    with pytest.raises(WireError, match="not a key set for this program"):
        check_evaluation_keys(data, keyset_from_specs({"keyset": keyset}))


@pytest.mark.parametrize("name", ["short blobs", "polynomial size", "shared blob", "slack"])
def test_server_refuses_such_keys_before_any_worker_starts(tmp_path, monkeypatch, name):
    monkeypatch.setenv("POLYFHE_CONCRETE_ENV", str(tmp_path / "nowhere"))  # a worker would fail: never reached
    data, keyset = _tampered(name)
    program = _program(tmp_path / "p", keyset)
    body = pack(KIND_CONTEXT, program.manifest.identity(), {"evaluation_keys": data})
    with pytest.raises(WireError, match="not a key set for this program"):
        ConcreteServer(program, body)


def test_upload_bound_is_what_a_client_sends_and_little_more(tmp_path):
    from polyfhe.program.engines import max_context_bytes

    program = _program(tmp_path / "p")
    keys, _ = write_keyset()
    upload = len(pack(KIND_CONTEXT, program.manifest.identity(), {"evaluation_keys": keys}))
    bound = max_context_bytes(program)
    assert bound is not None and upload <= bound <= upload + 8 * 2 * 60 + 1024  # landing pads and a segment table


def test_key_budget_counts_the_session_worker(tmp_path):
    from polyfhe.engines.concrete.keyset import SERVER_WORKER_BASE_BYTES
    from polyfhe.program.engines import decoded_context_bytes

    program = _program(tmp_path / "p")
    upload = 10_000
    # the server's copy of the keys, the worker's base, and its peak: the larger of five copies while Concrete
    # deserialises and the keys + every key expanded + the bootstrap keys once more (the Fourier conversion)
    expanded = 8 * (4 * 1 * 4 * 8 + 3 * 2 * 9 * 4 + 8 * 2 * 5 + 8 * 1 * 4 + 5 * 1 * 2 * 4 * 2)
    bootstrap = 8 * (4 * 1 * 4 * 8 + 3 * 2 * 9 * 4 + 5 * 1 * 2 * 4 * 2)
    want = upload + SERVER_WORKER_BASE_BYTES + max(5 * upload, upload + expanded + bootstrap)
    assert decoded_context_bytes(program, upload) == want
    assert decoded_context_bytes(program, 10 << 30) == (10 << 30) + SERVER_WORKER_BASE_BYTES + 5 * (10 << 30)


def _worker_env(folder: Path) -> Path:
    """A stand-in for Concrete ML's environment whose worker opens a server and dies on its keys (an abort)."""
    (folder / "bin").mkdir(parents=True)
    script = folder / "worker.py"
    worker_dir = Path(__file__).resolve().parents[3] / "polyfhe" / "engines" / "concrete"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(worker_dir)!r})\nimport worker_main as w\n"
                      "out = os.fdopen(os.dup(1), 'wb')\n"
                      "while True:\n    header, _ = w.read_frame(sys.stdin.buffer)\n"
                      "    if header['command'] == 'server_keys':\n        os._exit(134)\n"
                      "    w.write_frame(out, {'ok': True, 'stamp': w.worker_stamp()})\n")
    python = folder / "bin" / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script}\n")
    python.chmod(0o755)
    return folder


def test_keys_that_end_the_worker_are_refused_and_cost_that_session_alone(tmp_path, monkeypatch):
    """Keys that pass the walk but end Concrete's worker as it loads them: refused (a 400 from a server), and the
    worker was this session's own."""
    from polyfhe.engines.concrete import program as program_module
    from polyfhe.engines.concrete.worker import Worker

    env = ConcreteEnv(_worker_env(tmp_path / "env"))
    monkeypatch.setattr(program_module, "Worker", lambda role, threads=None: Worker(role, env, threads=threads))
    program = _program(tmp_path / "p")
    keys, _ = write_keyset()
    body = pack(KIND_CONTEXT, program.manifest.identity(), {"evaluation_keys": keys})
    with pytest.raises(WireError, match="ended while it loaded the evaluation keys"):
        ConcreteServer(program, body)
