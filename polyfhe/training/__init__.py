"""Training loop, recipe and checkpoints for polynomial networks (GPU when present, CPU otherwise)."""
