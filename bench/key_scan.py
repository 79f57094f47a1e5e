"""Cost of the residue scan over SEAL keys (polyfhe.engines.seal.sealbytes) beside SEAL's own load of the same bytes.

For a N=16384 program's public context (30 Galois keys by default, a relinearisation key, the public key) the
keys are generated once, inflated into an in-memory file as the server does, then timed, best of ``--repeat``:
the structure walk and scan (:func:`check_kswitch` / :func:`check_ciphertext`, which read every residue), and
SEAL's ``load`` of the same uncompressed bytes (which parses them and runs ``is_valid_for``). Also the scan alone
on a large buffer (seconds per GB). Prints a table with the machine's details.

    python bench/key_scan.py [--keys 30] [--n 16384] [--bits 50,37x9,50] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

from polyfhe.engines.seal.context import SealContext, _memory_file
from polyfhe.engines.seal.sealbytes import (
    HEADER,
    check_ciphertext,
    check_kswitch,
    expected_bytes,
    inflate_into,
    scan_polynomial,
    seal_layout,
)
from polyfhe.program.params import CKKSParams


def _bits(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        value, _, times = part.partition("x")
        out += [int(value)] * int(times or 1)
    return tuple(out)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--bits", default="50,37x9,50", help="coefficient modulus bits (default: monet_fhe_bn's)")
    ap.add_argument("--keys", type=int, default=30, help="Galois keys in the context")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scan-mb", type=int, default=512, help="size of the plain scan's buffer")
    args = ap.parse_args(argv)

    params = CKKSParams(args.n, _bits(args.bits), 37)
    seal = SealContext(params)
    sa = seal.sa
    layout = seal_layout(seal.context, args.n)
    keygen = sa.KeyGenerator(seal.context)
    elements = sorted({pow(3, k, 2 * args.n) for k in range(1, args.keys + 1)})
    t0 = time.perf_counter()
    objects = {"galois_keys": sa.GaloisKeys(), "relin_keys": sa.RelinKeys(), "public_key": sa.PublicKey()}
    keygen.create_galois_keys(elements, objects["galois_keys"])
    keygen.create_relin_keys(objects["relin_keys"])
    keygen.create_public_key(objects["public_key"])
    keygen_s = time.perf_counter() - t0
    factory = {"galois_keys": sa.GaloisKeys, "relin_keys": sa.RelinKeys, "public_key": sa.PublicKey}
    rows = {(e & (2 * args.n - 1)) >> 1 for e in elements}

    print(f"machine: {_cpu()}, {os.cpu_count()} cores; numpy {np.__version__}; Python {sys.version.split()[0]}")
    print(f"parameters: N={args.n}, {len(params.coeff_mod_bits)} primes {list(params.coeff_mod_bits)}, "
          f"{len(elements)} Galois keys (generated in {keygen_s:.1f} s)\n")
    header = "| object | inflated MB | walk + scan s | scan s/GB | SEAL load s | SEAL s/GB | scan / load |"
    print(header)
    print("|" + "---|" * 7)
    totals = [0, 0.0, 0.0]
    for kind, obj in objects.items():
        data = seal.dump(obj)
        with _memory_file() as (fd, path):
            length = inflate_into(fd, data, expected_bytes(layout, kind, len(rows)), kind)
            if kind == "public_key":
                def check(fd=fd, length=length, kind=kind):
                    check_ciphertext(fd, HEADER.size, length, layout, key_level=True, what=kind)
            else:
                def check(fd=fd, length=length, kind=kind):
                    check_kswitch(fd, length, layout, rows if kind == "galois_keys" else None, kind)

            def load(kind=kind, path=path):
                factory[kind]().load(seal.context, path)

            scan_s, load_s = _best(check, args.repeat), _best(load, args.repeat)
        gb = length / 1e9
        totals = [totals[0] + length, totals[1] + scan_s, totals[2] + load_s]
        print(f"| {kind} | {length / 1e6:.1f} | {scan_s:.3f} | {scan_s / gb:.3f} | {load_s:.3f} | {load_s / gb:.3f} | "
              f"{scan_s / load_s:.2f} |")
    gb = totals[0] / 1e9
    print(f"| context | {totals[0] / 1e6:.1f} | {totals[1]:.3f} | {totals[1] / gb:.3f} | {totals[2]:.3f} | "
          f"{totals[2] / gb:.3f} | {totals[1] / totals[2]:.2f} |")

    rng = np.random.default_rng(0)
    n, primes = args.n, max(1, args.scan_mb * (1 << 20) // (8 * args.n))
    moduli = np.array(layout.key_moduli[:1] * primes, dtype=np.uint64)
    buf = (rng.integers(1, int(moduli[0]), (primes, n), dtype=np.uint64)).astype("<u8").tobytes()
    with _memory_file() as (fd, _):
        os.pwrite(fd, buf, 0)
        from_fd = _best(lambda: scan_polynomial(fd, 0, n, moduli, "bench"), args.repeat)
    in_memory = _best(lambda: scan_polynomial(buf, 0, n, moduli, "bench"), args.repeat)
    gb = len(buf) / 1e9
    print(f"\nscan alone on {len(buf) / 1e6:.0f} MB: {from_fd / gb:.3f} s/GB from an in-memory file (read in "
          f"4 MiB chunks), {in_memory / gb:.3f} s/GB in place")
    return 0


if __name__ == "__main__":
    sys.exit(main())
