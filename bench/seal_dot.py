"""A giant step's inner sum on SEAL: products and sums one by one against polyfhe's dot kernel, in one run.

    python bench/seal_dot.py                       # N=16384, cpolynext_fhe_bn's chain, 12 / 7 / 3 primes
    python bench/seal_dot.py --terms 16 64 --repeats 5 --out /tmp/dot

Each row streams ``terms`` distinct ciphertexts and plaintexts (as a BSGS giant step reads its baby rotations
and diagonals) at one level, and times, on one core, the fastest of ``--repeats`` passes of

* the path before the kernel: SEAL's ``multiply_plain`` then ``add_inplace`` per term, both called without the
  GIL (``polyfhe/engines/seal/native.py``), exactly what ``SealOps`` ran before;
* the dot kernel (``polyfhe/engines/seal/_kernels.c``): one pass, products accumulated in 128 bits and reduced once.

Both results are compared byte for byte. Timing does not depend on security, so the ring is built without the
128-bit check (``--chain`` may be any chain). A table (with the machine's details), ``seal_dot.json`` and
``seal_dot.png`` land in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine_info import machine_info

DEFAULT_OUT = HERE / "results"
DEFAULT_CHAIN = (48, *([31] * 11), 48)  # cpolynext_fhe_bn at 28x28: 12 data primes, 11 levels at 2^31


def measure(ring: int, chain: tuple[int, ...], primes_list: list[int], terms_list: list[int],
            repeats: int) -> list[dict]:
    """One row per (primes, terms): milliseconds per term both ways, and whether the bytes agree."""
    from polyfhe.cost.opbench import best_seconds
    from polyfhe.engines.seal.context import SealContext
    from polyfhe.engines.seal.native import native_kernels
    from polyfhe.program.params import CKKSParams

    seal = SealContext(CKKSParams(ring, tuple(chain), chain[1], "none"))
    native = native_kernels(seal)
    if native is None or not native.dot_terms:
        raise SystemExit("the dot kernel is not available in this install (see the log): pip install -e . where a "
                         "C compiler is present")
    sa = seal.sa
    keygen = sa.KeyGenerator(seal.context)
    public = sa.PublicKey()
    keygen.create_public_key(public)
    encryptor = sa.Encryptor(seal.context, public)
    rng = np.random.default_rng(0)
    data_primes = len(chain) - 1
    rows = []
    for primes in primes_list:
        if not 1 <= primes <= data_primes:
            raise SystemExit(f"--primes {primes}: the chain {list(chain)} has 1..{data_primes} data primes")
        if sum(chain[:primes]) <= 2 * chain[1]:
            raise SystemExit(f"--primes {primes}: {sum(chain[:primes])} bits cannot hold a product at a "
                             f"{chain[1]}-bit scale times a {chain[1]}-bit plaintext (a program rescales before)")
        parms_id = seal.parms_id_at(data_primes - primes)
        for terms in terms_list:
            cts = []
            for _ in range(terms):
                ct = sa.Ciphertext()
                encryptor.encrypt(seal.encode(rng.uniform(-1, 1, seal.slots), parms_id, seal.params.scale), ct)
                cts.append(ct)
            pts = [seal.encode(rng.uniform(-1, 1, seal.slots), parms_id, seal.params.scale) for _ in range(terms)]

            def one_by_one(cts=cts, pts=pts):
                total = native.multiply_plain(cts[0], pts[0])
                for ct, pt in zip(cts[1:], pts[1:], strict=True):
                    native.add_inplace(total, native.multiply_plain(ct, pt))
                return total

            def fused(cts=cts, pts=pts):
                return native.dot(cts, pts)

            same = seal.dump(one_by_one()) == seal.dump(fused())  # also the warm-up: memory pool, caches
            before, after = best_seconds(one_by_one, repeats), best_seconds(fused, repeats)
            rows.append({"ring": ring, "primes": primes, "terms": terms, "seal_ms": 1e3 * before / terms,
                         "dot_ms": 1e3 * after / terms, "speedup": before / after, "identical": same})
    return rows


def render(info: dict, rows: list[dict]) -> str:
    lines = [(f"machine: {info['cpu']}, {info['usable_cores']} cores, load {info['load_avg_1m']:.2f}, "
             f"Python {info['python']}; one core, fastest of {info['repeats']} passes, warm"),
             "", ("| N | primes | terms | SEAL multiply_plain + add_inplace (ms per term) | dot kernel (ms per term) "
             "| speedup | identical bytes |"), "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['ring']} | {r['primes']} | {r['terms']} | {r['seal_ms']:.3f} | {r['dot_ms']:.3f} | "
                     f"{r['speedup']:.2f}x | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['primes']} primes\n{r['terms']} terms" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.3 * len(rows)), 3.5))
    ax.bar(x - 0.2, [r["seal_ms"] for r in rows], 0.4, label="SEAL product + sum")
    ax.bar(x + 0.2, [r["dot_ms"] for r in rows], 0.4, label="dot kernel")
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("ms per plaintext diagonal")
    ax.set_title(f"giant-step inner sum, N={rows[0]['ring']}, one core")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ring", type=int, default=16384)
    parser.add_argument("--chain", type=int, nargs="+", default=list(DEFAULT_CHAIN),
                        help="prime bits: first, one per level, special")
    parser.add_argument("--primes", type=int, nargs="+", default=[12, 7, 3], help="data primes of the rows")
    parser.add_argument("--terms", type=int, nargs="+", default=[16, 64], help="diagonals per inner sum")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    rows = measure(args.ring, tuple(args.chain), args.primes, args.terms, args.repeats)
    info = {**machine_info(), "repeats": args.repeats}
    table = render(info, rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seal_dot.json").write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
    (args.out / "seal_dot.md").write_text(table + "\n")
    plot(rows, args.out / "seal_dot.png")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
