"""The process that runs inside Concrete ML's environment (started by :mod:`polyfhe.engines.concrete.worker`).

It imports Concrete ML, never polyfhe (which is not installed there). It reads framed requests on stdin and writes
framed replies on stdout: ``MAGIC`` | uint32 header length | JSON header | blobs, the header listing each blob's
length. Arrays travel as raw little-endian float64 with their shape in the header: nothing is pickled. Anything
Concrete ML prints goes to stderr, so stdout carries only frames. One worker serves one role: a compiler, one
client (its keys never leave this process's memory) or one server (one client's evaluation keys). The framing,
the limits and the request loop are polyfhe's worker framework (``polyfhe/workers``, standard library only),
loaded by path; the parent's first request is ``hello``, answered with this worker's environment stamp.

``--address-space BYTES``: the process limits its own address space (``RLIMIT_AS``) before it imports anything,
so Concrete's native code cannot map more while it parses bytes from outside (the parent counts the limit in its
memory budget); a request whose blobs together pass ``MAX_REQUEST_BYTES`` is refused unread.
"""

import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _load_framework():
    """polyfhe's worker framework (``polyfhe/workers``: standard library only) under a private package name: polyfhe
    itself is not installed in this environment, and the folder is not put on ``sys.path`` (its module names
    could shadow a package of Concrete ML's)."""
    name = "_polyfhe_workers"
    if name not in sys.modules:
        folder = Path(__file__).resolve().parents[2] / "workers"
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        spec.loader.exec_module(package)
    return sys.modules[name]


_load_framework()
from _polyfhe_workers import child_main, framing, limits, stamp  # loaded by path just above

MAGIC = b"PFCW"
MAX_HEADER = 1 << 20
MAX_REQUEST_BYTES = 8 << 30  # as the parent's bound (polyfhe.engines.concrete.worker.MAX_REQUEST_BYTES)
PROTOCOL = "concrete-worker-1"  # the parent refuses a worker whose hello reports another
FRAMES = framing.FrameFormat(MAGIC, MAX_HEADER, MAX_REQUEST_BYTES)

limit_address_space = limits.limit_address_space
address_space_argument = limits.address_space_argument
read_exact = framing.read_exact
read_frame = FRAMES.read
write_frame = FRAMES.write


def worker_stamp():
    """This worker's environment stamp (its hello): the protocol and the interpreter, no Concrete import."""
    return stamp.environment_stamp(PROTOCOL)


def to_array(blob, shape):
    import numpy

    return numpy.frombuffer(blob, dtype="<f8").reshape(shape).copy()


def from_array(arr):
    import numpy

    arr = numpy.ascontiguousarray(arr, dtype="<f8")
    return {"shape": list(arr.shape)}, arr.tobytes()


class BadInput(Exception):
    """Bytes from outside that Concrete refused: the parent turns this into its own input error."""


STATE = {}


def cmd_ping(header, blobs):
    import concrete.fhe
    import concrete.ml
    import torch

    return {"concrete_ml": concrete.ml.__version__, "concrete_python": concrete.fhe.__version__,
            "torch": torch.__version__, "python": sys.version.split()[0]}, []


def predict_keys(circuit):
    """What the compiled circuit's keys will take, read before any key is made.

    ``evaluation_keys_bytes``: the serialised evaluation keys, counted from the key set's parameters the way
    Concrete writes them (seeded keys keep one body per row when ``compress_evaluation_keys`` is on): a bootstrap
    key is n_in * level * (k+1) * N words (times k+1 more uncompressed), a keyswitch key n_in * level words (times
    n_out+1). ``*_in_memory``: Concrete's own compilation feedback (``size_of_bootstrap_keys`` and
    ``size_of_keyswitch_keys``), the expanded keys the key generator holds."""
    keyset = circuit.server.program_info.get_keyset_info()
    compressed = bool(getattr(circuit.configuration, "compress_evaluation_keys", False))
    dims = [key.dimension() for key in keyset.secret_keys()]
    bootstrap, keyswitch, params = 0, 0, []
    for key in keyset.bootstrap_keys():
        rows = key.input_lwe_dimension() * key.level() * (key.glwe_dimension() + 1)
        bootstrap += 8 * rows * key.polynomial_size() * (1 if compressed else key.glwe_dimension() + 1)
        params.append({"polynomial_size": key.polynomial_size(), "glwe_dimension": key.glwe_dimension(),
                       "input_lwe_dimension": key.input_lwe_dimension(), "level": key.level()})
    for key in keyset.keyswitch_keys():
        n_in, n_out = dims[key.input_secret_key_id()], dims[key.output_secret_key_id()]
        keyswitch += 8 * n_in * key.level() * (1 if compressed else n_out + 1)
    packing = keyset.packing_keyswitch_keys()
    prediction = {"evaluation_keys_bytes": bootstrap + keyswitch, "bootstrap_keys_bytes": bootstrap,
                  "keyswitch_keys_bytes": keyswitch, "packing_keyswitch_keys": len(packing),
                  "compressed": compressed, "bootstrap_keys": params}
    for name, attr in (("bootstrap_keys_bytes_in_memory", "size_of_bootstrap_keys"),
                       ("keyswitch_keys_bytes_in_memory", "size_of_keyswitch_keys"),
                       ("secret_keys_bytes", "size_of_secret_keys"), ("complexity", "complexity")):
        try:
            prediction[name] = int(getattr(circuit, attr))
        except Exception:  # noqa: BLE001, S112 - absent from some Concrete versions: report what exists
            continue
    if packing:  # not counted above: bound them by the expanded size Concrete reports for keyswitch keys
        prediction["evaluation_keys_bytes"] += prediction.get("keyswitch_keys_bytes_in_memory", 0)
    return prediction


def _compiled(header, blobs):
    """Concrete ML's quantised module for these settings, compiled once per worker (a grid's candidates are kept,
    so saving the chosen one does not compile it again)."""
    import hashlib

    import onnx
    from concrete.ml.torch.compile import compile_onnx_model

    settings = {k: header.get(k) for k in ("n_bits", "rounding_threshold_bits", "p_error", "global_p_error")}
    digest = hashlib.sha256(blobs[0] + blobs[1] + json.dumps(settings, sort_keys=True).encode()).hexdigest()
    cache = STATE.setdefault("compiled", {})
    if digest in cache:
        return cache[digest], 0.0
    model = onnx.load_from_string(blobs[0])
    inputset = to_array(blobs[1], header["inputset_shape"]).astype("float32")
    t0 = time.perf_counter()
    qm = compile_onnx_model(model, inputset, n_bits=settings["n_bits"],
                            rounding_threshold_bits=settings["rounding_threshold_bits"],
                            p_error=settings["p_error"], global_p_error=settings["global_p_error"])
    seconds = time.perf_counter() - t0
    if len(cache) >= 16:
        cache.pop(next(iter(cache)))
    cache[digest] = qm
    return qm, seconds


def cmd_compile(header, blobs):
    """Compile (or reuse) one setting; ``save`` (default true) writes the program into ``out``; with a third blob,
    the quantised model's outputs on it (``simulate``, default true: Concrete's FHE simulation's too)."""
    from concrete.ml.deployment import FHEModelDev

    qm, seconds = _compiled(header, blobs)
    if header.get("save", True):
        staging = tempfile.mkdtemp(dir=header["out"])  # Concrete ML saves only into an empty folder
        FHEModelDev(staging, qm).save()
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(header["out"], name))
        os.rmdir(staging)
    circuit = qm.fhe_circuit
    stats = {}
    for key in ("programmable_bootstrap_count", "key_switch_count", "packing_key_switch_count",
                "clear_addition_count", "encrypted_addition_count", "clear_multiplication_count",
                "encrypted_negation_count", "complexity"):
        try:
            value = getattr(circuit, key)
            stats[key] = int(value) if not isinstance(value, dict) else None
        except Exception:  # noqa: BLE001, S112 - counters differ between Concrete versions: report what exists
            continue
    reply = {"compile_seconds": seconds, "max_bit_width": int(circuit.graph.maximum_integer_bit_width()),
             "p_error": float(circuit.p_error), "global_p_error": float(circuit.global_p_error),
             "statistics": {k: v for k, v in stats.items() if v is not None}, "keys": predict_keys(circuit)}
    out = []
    if len(blobs) > 2:
        x = to_array(blobs[2], header["eval_shape"]).astype("float32")
        for mode in ("disable", "simulate") if header.get("simulate", True) else ("disable",):
            t0 = time.perf_counter()
            meta, blob = from_array(qm.forward(x, fhe=mode))
            reply[f"{mode}_shape"] = meta["shape"]
            reply[f"{mode}_seconds"] = time.perf_counter() - t0
            out.append(blob)
    return reply, out


def cmd_limits(header, blobs):
    """This worker's own limits (no Concrete import: the parent's tests read them without Concrete ML)."""
    return {"address_space": limits.address_space_limits(), "max_request_bytes": MAX_REQUEST_BYTES}, []


def cmd_hello(header, blobs):
    """The first request of every worker: its environment stamp, which the parent checks before any work."""
    return {"stamp": worker_stamp()}, []


def cmd_client_open(header, blobs):
    from concrete.ml.deployment import FHEModelClient

    STATE["client"] = FHEModelClient(header["dir"])  # no key_dir: the keys stay in this process's memory
    return {}, []


def cmd_keygen(header, blobs):
    client = STATE["client"]
    t0 = time.perf_counter()
    client.generate_private_and_evaluation_keys(force=True)
    keys = client.get_serialized_evaluation_keys()
    return {"seconds": time.perf_counter() - t0}, [keys]


def cmd_encrypt(header, blobs):
    # float32, as compile quantised the calibration and evaluation inputs: an input exactly on a quantiser step's
    # midpoint (the digits' 8 at n_bits=6) rounds one way in float32 and the other in float64
    x = to_array(blobs[0], header["shape"]).astype("float32")
    return {}, [STATE["client"].quantize_encrypt_serialize(x)]


def cmd_decrypt(header, blobs):
    try:
        y = STATE["client"].deserialize_decrypt_dequantize(blobs[0])
    except Exception as exc:
        raise BadInput(f"{type(exc).__name__}: {exc}") from exc
    meta, blob = from_array(y)
    return meta, [blob]


def cmd_server_open(header, blobs):
    from concrete.ml.deployment import FHEModelServer

    STATE["server"] = FHEModelServer(header["dir"])
    return {}, []


def cmd_server_keys(header, blobs):
    from concrete import fhe

    try:
        STATE["keys"] = fhe.EvaluationKeys.deserialize(blobs[0])
    except Exception as exc:
        raise BadInput(f"evaluation keys: {type(exc).__name__}: {exc}") from exc
    return {}, []


def cmd_server_run(header, blobs):
    from concrete.ml.deployment.fhe_client_server import (
        deserialize_encrypted_values,
        serialize_encrypted_values,
    )

    try:
        value = deserialize_encrypted_values(blobs[0])
    except Exception as exc:
        raise BadInput(f"ciphertext: {type(exc).__name__}: {exc}") from exc
    t0 = time.perf_counter()
    try:
        values = value if isinstance(value, tuple) else (value,)
        result = STATE["server"].server.run(*values, evaluation_keys=STATE["keys"])
    except (RuntimeError, ValueError) as exc:  # a value of the wrong type or shape for this circuit
        raise BadInput(f"ciphertext: {type(exc).__name__}: {exc}") from exc
    return {"seconds": time.perf_counter() - t0}, [serialize_encrypted_values(*(result if isinstance(result, tuple) else (result,)))]


COMMANDS = {name[4:]: fn for name, fn in globals().items() if name.startswith("cmd_")}


def main():
    limit = address_space_argument(sys.argv[1:])
    if limit is not None:
        limit_address_space(limit)
    protocol = child_main.protect_stdout()
    child_main.serve_requests(COMMANDS, FRAMES, sys.stdin.buffer, protocol, BadInput)


if __name__ == "__main__":
    main()
