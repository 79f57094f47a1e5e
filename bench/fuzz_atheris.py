"""Coverage-guided fuzzing (atheris / libFuzzer) of what the server decodes: containers, SEAL objects, keys.

    pip install atheris                                    # optional; not a project dependency
    python bench/fuzz_atheris.py -max_total_time=300       # libFuzzer flags pass through
    python bench/fuzz_atheris.py CORPUS_DIR -rss_limit_mb=1024 -max_len=1000000

The first input byte picks a target, the rest is its input:

- 0 container: ``wire.unpack`` and the HTTP upload check (``check_upload``) of the bytes as a ciphertext
  container;
- 1 ciphertext object: the bytes as the SEAL object of the input ciphertext (in a valid container), served;
- 2 ciphertext members: the bytes replace the start of the ciphertext's uncompressed payload (metadata, the
  coefficient array's header), the real coefficients follow, stored uncompressed, zlib or zstd; served;
- 3 key object: the bytes as the relinearisation or Galois key set of a public context, which is loaded and,
  if accepted, serves a valid ciphertext;
- 4 public key object: likewise for the public key.

Any exception other than ``WireError``/``SerializationError`` (or the upload check's ``ApiError``) is a
finding, and so is a crash; ``-rss_limit_mb`` (default here 1024) turns a decompression bomb into one. The
program is the serve tests' tiny one (N=8192, 8 rotations); keys are made once. polyfhe's own modules are
instrumented (the SEAL library is native: crashes there are seen, its branches are not).
"""

from __future__ import annotations

import sys
import tempfile
import zlib
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["polyfhe.program.wire", "polyfhe.engines.seal.sealbytes", "polyfhe.engines.seal.server",
                                         "polyfhe.engines.seal.context", "polyfhe.serve.uploads"]):
    from polyfhe.engines.seal import context, server  # noqa: F401
    from polyfhe.engines.seal.context import SerializationError
    from polyfhe.engines.seal.sealbytes import CT_MEMBERS, DYNARRAY_PREFIX, HEADER
    from polyfhe.program import wire  # noqa: F401 - instrumented here
    from polyfhe.program.wire import KIND_CIPHERTEXT, KIND_CONTEXT, WireError, pack, unpack
    from polyfhe.serve.errors import ApiError
    from polyfhe.serve.uploads import check_upload

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from square_mlp import square_mlp_program

REFUSED = (WireError, SerializationError)
MEMBERS = CT_MEMBERS + DYNARRAY_PREFIX  # ciphertext metadata and its coefficient array's header


PROGRAM = square_mlp_program(12, 4, 64)  # the serve tests' ``tiny`` program
CLIENT = PROGRAM.client()
CONTEXT = CLIENT.public_context()
CIPHERTEXT = CLIENT.encrypt(np.random.default_rng(1).random(64))
SERVER = PROGRAM.server(CONTEXT)
CONTEXT_BOX, CT_BOX = unpack(CONTEXT, KIND_CONTEXT), unpack(CIPHERTEXT, KIND_CIPHERTEXT)
CT_PAYLOAD = zstandard.ZstdDecompressor().stream_reader(bytes(CT_BOX.sections["ct0"])[HEADER.size:]).read()


def _seal(payload: bytes, mode: int) -> bytes:
    if mode == 2:
        body = zstandard.ZstdCompressor(level=1).compress(payload)
    else:
        body = zlib.compress(payload, 1) if mode == 1 else payload
    return HEADER.pack(0xA15E, HEADER.size, 4, 3, mode, 0, HEADER.size + len(body)) + body


def _serve(ciphertext: bytes) -> None:
    try:
        out = SERVER.run(ciphertext)
    except REFUSED as exc:
        assert str(exc), "a refusal without a message"
        return
    assert CLIENT.decrypt(out).shape == (1, 4)


def _context(**objects: bytes) -> None:
    data = pack(KIND_CONTEXT, CONTEXT_BOX.header, {**CONTEXT_BOX.sections, **objects})
    try:
        evaluator = PROGRAM.server(data)
        out = evaluator.run(CIPHERTEXT)
    except REFUSED as exc:
        assert str(exc), "a refusal without a message"
        return
    assert CLIENT.decrypt(out).shape == (1, 4)


def test_one_input(data: bytes) -> None:
    if not data:
        return
    target, rest = data[0] % 5, data[1:]
    if target == 0:
        try:
            unpack(rest, KIND_CIPHERTEXT)
        except WireError as exc:
            assert str(exc)
        try:
            check_upload(rest, KIND_CIPHERTEXT, PROGRAM)
        except ApiError as exc:
            assert exc.status in (400, 422) and exc.detail
    elif target == 1:
        _serve(pack(KIND_CIPHERTEXT, CT_BOX.header, {"ct0": rest}))
    elif target == 2:
        mode = (rest[0] % 3) if rest else 0
        payload = rest[1:MEMBERS + 1] + CT_PAYLOAD[MEMBERS:]
        _serve(pack(KIND_CIPHERTEXT, CT_BOX.header, {"ct0": _seal(payload, mode)}))
    elif target == 3:
        name = "galois_keys" if rest[:1] and rest[0] & 1 else "relin_keys"
        _context(**{name: rest[1:]})
    else:
        _context(public_key=rest)


def seeds(folder: Path) -> None:
    """Small starting inputs: a container header, ciphertext members, small SEAL objects, a zstd RLE frame."""
    ct_members = CT_PAYLOAD[:MEMBERS]
    frame = b"\x28\xb5\x2f\xfd\x00\x38" + (131072 << 3 | 1 << 1 | 1).to_bytes(3, "little") + b"\0"
    samples = {
        "container": b"\0" + CIPHERTEXT[:400],
        "members-zstd": b"\2\2" + ct_members, "members-none": b"\2\0" + ct_members,
        "ct-object": b"\1" + _seal(CT_PAYLOAD[:2000], 2),
        "relin-prefix": b"\3\0" + _seal(bytes(CONTEXT_BOX.sections["relin_keys"])[16:200], 2),
        "galois-rle": b"\3\1" + HEADER.pack(0xA15E, 16, 4, 3, 2, 0, 16 + len(frame)) + frame,
        "public-key": b"\4" + bytes(CONTEXT_BOX.sections["public_key"])[:2000],
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, sample in samples.items():
        (folder / name).write_bytes(sample)


def main() -> None:
    argv = list(sys.argv)
    if not any(a.startswith("-rss_limit_mb") for a in argv):
        argv.append("-rss_limit_mb=1024")
    if not any(a.startswith("-max_len") for a in argv):
        argv.append("-max_len=600000")
    corpus = [a for a in argv[1:] if not a.startswith("-")]
    if not corpus:
        corpus_dir = Path(tempfile.mkdtemp(prefix="polyfhe-fuzz-"))
        argv.insert(1, str(corpus_dir))
        corpus = [str(corpus_dir)]
    if not any(Path(c).is_dir() and any(Path(c).iterdir()) for c in corpus):
        seeds(Path(corpus[0]))
    if not any(a.startswith("-artifact_prefix") for a in argv):  # crash files beside the corpus, not in cwd
        argv.append(f"-artifact_prefix={Path(corpus[0]).resolve()}/../")
    print(f"corpus: {corpus[0]}", file=sys.stderr)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
