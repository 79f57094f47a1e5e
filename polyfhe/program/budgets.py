"""The default budgets a CKKS program is planned within. Here, in a module that imports nothing, so that the
command line shows them without loading the compiler (numpy, onnx, torch)."""

from __future__ import annotations

__all__ = ["BATCH_MEMORY_BUDGET", "GALOIS_KEY_BUDGET"]

BATCH_MEMORY_BUDGET = 8 << 30  # bytes of live ciphertexts the batch layout may plan for
GALOIS_KEY_BUDGET = 3 << 30  # bytes of Galois keys in a public context (beyond it, rotations are chains of keys)
