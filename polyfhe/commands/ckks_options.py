"""``polyfhe export``'s CKKS parameter overrides and budgets, as flags for every ``export_ckks`` option."""

from __future__ import annotations

import argparse
from typing import Any

from polyfhe.commands.arguments import non_negative_float, positive_int, power_of_two
from polyfhe.program.budgets import BATCH_MEMORY_BUDGET, GALOIS_KEY_BUDGET

__all__ = ["add_ckks_parameter_arguments", "ckks_parameter_options"]

MIB = 1 << 20


def add_ckks_parameter_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CKKS parameters (default: the smallest 128-bit secure ones that fit the model)")
    g.add_argument("--poly-modulus-degree", type=power_of_two, metavar="N",
                   help="ring size N (N/2 slots), e.g. 8192, 16384 or 32768 for a leveled program")
    g.add_argument("--scale-bits", type=positive_int, metavar="B", help="scale 2^B (one prime of B bits per level)")
    g.add_argument("--coeff-mod-bits", type=_bit_list, metavar="B,B,...",
                   help="the whole modulus chain (first prime, one per level, special prime); needs "
                        "--poly-modulus-degree and --scale-bits")
    g.add_argument("--allow-insecure", action="store_true",
                   help="accept parameters below 128-bit security, with a loud warning (experiments only)")
    g.add_argument("--galois-key-budget-mb", type=non_negative_float, default=GALOIS_KEY_BUDGET / MIB, metavar="MB",
                   help="seal: rotation keys in the public context (as sent); past it, rotations by steps without "
                        "a key are chains of keyed steps, several key switches each (default "
                        f"{GALOIS_KEY_BUDGET / MIB:g} MiB)")
    g.add_argument("--for-browser", action="store_true",
                   help="seal: a program the web page can be the client of: its public context, as the page "
                        "sends it (seeded keys), stays within 150 MB (Galois keys cut to fit; other rotations "
                        "composed); same as --upload-budget-mb 150")
    g.add_argument("--upload-budget-mb", type=non_negative_float, metavar="MB",
                   help="seal: the public context as the web page sends it stays within MB (10^6 bytes)")
    g.add_argument("--batch-memory-mb", type=non_negative_float, default=BATCH_MEMORY_BUDGET / MIB, metavar="MB",
                   help="batch layout: live ciphertexts the plan may hold; a model needing more is refused "
                        f"(default {BATCH_MEMORY_BUDGET / MIB:g} MiB)")


def _upload_budget(args: argparse.Namespace) -> int | None:
    from polyfhe.program.params import BROWSER_UPLOAD_BUDGET

    if args.upload_budget_mb is not None:
        return int(args.upload_budget_mb * 10**6)
    return BROWSER_UPLOAD_BUDGET if args.for_browser else None


def _bit_list(text: str) -> tuple[int, ...]:
    try:
        bits = tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected prime sizes in bits separated by commas, got {text!r}") from None
    if len(bits) < 2:
        raise argparse.ArgumentTypeError(f"expected at least two primes (first and special), got {text!r}")
    return bits


def ckks_parameter_options(args: argparse.Namespace) -> dict[str, Any]:
    """``export_ckks`` keyword arguments from the flags; ``ValueError`` for a chain without ring or scale."""
    options: dict[str, Any] = {"allow_insecure": args.allow_insecure,
                               "galois_key_budget": int(args.galois_key_budget_mb * MIB),
                               "batch_memory_budget": int(args.batch_memory_mb * MIB),
                               "upload_budget": _upload_budget(args)}
    if args.coeff_mod_bits is None:
        return {**options, "poly_modulus_degree": args.poly_modulus_degree, "scale_bits": args.scale_bits}
    if args.poly_modulus_degree is None or args.scale_bits is None:
        raise ValueError("--coeff-mod-bits needs --poly-modulus-degree and --scale-bits")
    from polyfhe.program.params import CKKSParams

    return {**options, "params": CKKSParams(args.poly_modulus_degree, args.coeff_mod_bits, args.scale_bits)}
