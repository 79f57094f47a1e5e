"""What a bootstrapping Lattigo server holds in memory: the key copies while it starts, and its peak model."""

from __future__ import annotations

__all__ = ["LATTIGO_KEY_COPIES", "SERVER_BOOT_KEY_COPIES", "server_peak_bytes"]

# A Lattigo server holds its key set three times while it starts: the uploaded context, Go's copy of it and the
# unmarshalled keys.
LATTIGO_KEY_COPIES = 3
# A bootstrapping Lattigo server, measured on monet_fhe_deep_bn (width 64: 9,992 and, shifts factored, 3,833
# diagonals; 4.26 GB of bootstrapping keys for 2^13 slots on N=2^16; residual N=2^14; GOGC=25). It loads the keys
# first, so their copies are collected before the diagonals are encoded. Serving,
# Go's heap holds every encoded diagonal (1.3x the planner's plaintext bytes: Lattigo's transforms beside the raw
# float64 diagonals), the keys, and the bootstrapper's own transforms and temporaries (0.85x its key bytes), and
# grows by GOGC=25% past what is live before it collects; the Python process adds about 1 GB.
SERVER_PLAINTEXT_FACTOR = 1.3
BOOTSTRAPPER_STATE_PER_KEY_BYTE = 0.85
GO_HEAP_GROWTH = 1.25
SERVER_PROCESS_BYTES = 1_000_000_000
# The bootstrapping keys a running server holds while it loads them, as the cost model counts its memory
SERVER_BOOT_KEY_COPIES = 2.0


def server_peak_bytes(plaintext_bytes: int, bootstrap_keys: int, galois_keys: int) -> tuple[int, int]:
    """(while loading the keys, while serving): a bootstrapping Lattigo server's resident bytes (see
    ``SERVER_PLAINTEXT_FACTOR``); the larger is its peak."""
    loading = SERVER_PROCESS_BYTES + LATTIGO_KEY_COPIES * bootstrap_keys + galois_keys
    live = (SERVER_PLAINTEXT_FACTOR * plaintext_bytes + (1.0 + BOOTSTRAPPER_STATE_PER_KEY_BYTE) * bootstrap_keys
            + galois_keys)
    return int(loading), int(SERVER_PROCESS_BYTES + GO_HEAP_GROWTH * live)
