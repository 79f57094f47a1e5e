/* Native kernels for CKKS linear maps on SEAL's RNS data, called through ctypes (GIL released).
 *
 * polyfhe_dot: the inner sum of a BSGS giant step, sum_t ct_t * pt_t, in one pass. SEAL's multiply_plain
 * then add_inplace reduce every product and write every partial sum back to memory; here the products of each
 * coefficient are accumulated in 128 bits and reduced once, and each plaintext is read once for both
 * ciphertext polynomials. The result is canonical (every value in [0, q)), so it equals SEAL's byte for byte.
 *
 * The module has no Python functions: it is an extension module only so that setuptools builds it and
 * Python can locate it (polyfhe/fhe/seal_native.py opens it with ctypes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "_modarith.h"

/* Products of two residues below 2^60 are below 2^120: 2^8 of them fit 128 bits. */
#define POLYFHE_DOT_MAX_TERMS 256
#define BLOCK 256


int polyfhe_dot_max_terms(void) { return POLYFHE_DOT_MAX_TERMS; }

/* out = sum_t cts[t] * pts[t] for size-2 ciphertexts in NTT form: cts[t] holds 2 x primes x n residues
 * (polynomial, prime, coefficient), pts[t] primes x n, out 2 x primes x n. Returns 0, or -1 when terms is
 * out of range (nothing written). */
int polyfhe_dot(size_t terms, const uint64_t *const *cts, const uint64_t *const *pts, uint64_t *out,
                size_t primes, size_t n, const uint64_t *moduli, const uint64_t *ratios) {
    if (terms == 0 || terms > POLYFHE_DOT_MAX_TERMS) return -1;
    u128 acc0[BLOCK], acc1[BLOCK];
    for (size_t i = 0; i < primes; i++) {
        const uint64_t q = moduli[i], r0 = ratios[2 * i], r1 = ratios[2 * i + 1];
        for (size_t start = 0; start < n; start += BLOCK) {
            const size_t m = n - start < BLOCK ? n - start : BLOCK;
            for (size_t c = 0; c < m; c++) acc0[c] = acc1[c] = 0;
            for (size_t t = 0; t < terms; t++) {
                const uint64_t *a0 = cts[t] + i * n + start, *a1 = cts[t] + (primes + i) * n + start;
                const uint64_t *b = pts[t] + i * n + start;
                for (size_t c = 0; c < m; c++) {
                    acc0[c] += (u128)a0[c] * b[c];
                    acc1[c] += (u128)a1[c] * b[c];
                }
            }
            uint64_t *o0 = out + i * n + start, *o1 = out + (primes + i) * n + start;
            for (size_t c = 0; c < m; c++) {
                o0[c] = reduce128(acc0[c], q, r0, r1);
                o1[c] = reduce128(acc1[c], q, r0, r1);
            }
        }
    }
    return 0;
}

static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT, "_kernels", "Native CKKS kernels, opened with ctypes by polyfhe.fhe.seal_native.", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
