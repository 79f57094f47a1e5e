"""CKKS runtime: parameters, keys, client/server split and the program executor (numpy + TenSEAL only)."""
