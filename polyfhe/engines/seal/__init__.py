"""Microsoft SEAL through TenSEAL: client, server, native kernels, byte walkers."""
