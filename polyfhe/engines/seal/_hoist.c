/* Hoisted rotations for SEAL's CKKS ciphertexts, called through ctypes (GIL released).
 *
 * A rotation is a Galois automorphism and a key switch of the second polynomial c1. SEAL's key switch spends
 * most of its time decomposing c1: each of its L residues back to coefficients (an inverse NTT), reduced
 * modulo every other prime of the key and transformed again (L x L NTTs). The automorphism commutes with that
 * decomposition up to a permutation of NTT slots, so several rotations of one ciphertext (the baby steps of a
 * BSGS linear map) can share it: decompose c1 once (polyfhe_ks_decompose), then per rotation permute, multiply
 * with the step's key and divide by the special prime (polyfhe_ks_rotate: 2 (L + 1) NTTs instead of L (L + 2)).
 *
 * Residues of a permuted decomposition differ from those of SEAL's (a negated coefficient reduced modulo
 * another prime differs by a multiple of its own prime), which adds a key's noise times q_j / p to the result:
 * far below the scale. Decomposing the permuted c1 instead (SEAL's order) gives SEAL's bytes exactly, which is
 * what the self-test checks (polyfhe/engines/seal/hoist.py) before the hoisted path is used.
 *
 * Layouts, as SEAL keeps them: a ciphertext is 2 x L x n residues (polynomial, prime, coefficient) in NTT
 * form; a key is one ciphertext per decomposition digit, 2 x K x n over all K key primes (the special prime
 * last). The NTT is SEAL's (Harvey's negacyclic transform with bit-reversed powers of the minimal primitive
 * 2n-th root; tables made in hoist.py), every value here kept in [0, q).
 *
 * Like _kernels.c this is an extension module only so that setuptools builds it and Python can locate it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_modarith.h"

#define BLOCK 256
#define MAX_DIGITS 256 /* products below 2^120: 2^8 of them fit 128 bits */

/* One prime's tables: q, floor(2^128 / q) as two words, the NTT's powers and Shoup quotients. */
typedef struct {
    uint64_t q, r0, r1;
    const uint64_t *roots, *roots_shoup, *iroots, *iroots_shoup;
    uint64_t inv_n, inv_n_shoup;
} prime_tables;


/* a * w mod q with w's Shoup quotient floor(w 2^64 / q); a < 2^64, result in [0, q). */
static inline uint64_t mul_shoup(uint64_t a, uint64_t w, uint64_t w_shoup, uint64_t q) {
    uint64_t estimate = (uint64_t)(((u128)a * w_shoup) >> 64);
    uint64_t r = a * w - estimate * q;
    return r >= q ? r - q : r;
}

static inline uint64_t add_mod(uint64_t a, uint64_t b, uint64_t q) {
    uint64_t s = a + b;
    return s >= q ? s - q : s;
}

static inline uint64_t sub_mod(uint64_t a, uint64_t b, uint64_t q) { return a >= b ? a - b : a + q - b; }

/* a * w mod q up to one q (Harvey's lazy product): a < 2^64, result in [0, 2q). */
static inline uint64_t mul_shoup_lazy(uint64_t a, uint64_t w, uint64_t w_shoup, uint64_t q) {
    return a * w - (uint64_t)(((u128)a * w_shoup) >> 64) * q;
}

/* x mod q for x < 2^64 (Barrett, r1 the high word of floor(2^128 / q)). */
static inline uint64_t reduce64(uint64_t x, uint64_t q, uint64_t r1) {
    uint64_t r = x - (uint64_t)(((u128)x * r1) >> 64) * q;
    return r >= q ? r - q : r;
}

/* Forward negacyclic NTT in place (Cooley-Tukey, natural order in, bit-reversed out), as SEAL's: Harvey's lazy
 * butterflies keep values in [0, 4q); the result is reduced to [0, q). Input in [0, q). */
static void ntt(uint64_t *a, size_t n, const prime_tables *p) {
    const uint64_t q = p->q, two_q = 2 * q;
    size_t t = n;
    for (size_t m = 1; m < n; m <<= 1) {
        t >>= 1;
        for (size_t i = 0; i < m; i++) {
            const uint64_t w = p->roots[m + i], ws = p->roots_shoup[m + i];
            uint64_t *x = a + 2 * i * t, *y = x + t;
            for (size_t j = 0; j < t; j++) {
                uint64_t u = x[j];
                u = u >= two_q ? u - two_q : u;
                uint64_t v = mul_shoup_lazy(y[j], w, ws, q);
                x[j] = u + v;
                y[j] = u + two_q - v;
            }
        }
    }
    for (size_t j = 0; j < n; j++) {
        uint64_t v = a[j];
        v = v >= two_q ? v - two_q : v;
        a[j] = v >= q ? v - q : v;
    }
}

/* Inverse of ntt (Gentleman-Sande, lazy in [0, 2q)), including the factor 1/n; result in [0, q). */
static void intt(uint64_t *a, size_t n, const prime_tables *p) {
    const uint64_t q = p->q, two_q = 2 * q;
    size_t t = 1;
    for (size_t m = n; m > 1; m >>= 1) {
        size_t h = m >> 1;
        for (size_t i = 0; i < h; i++) {
            const uint64_t w = p->iroots[h + i], ws = p->iroots_shoup[h + i];
            uint64_t *x = a + 2 * i * t, *y = x + t;
            for (size_t j = 0; j < t; j++) {
                uint64_t u = x[j], v = y[j];
                uint64_t s = u + v;
                x[j] = s >= two_q ? s - two_q : s;
                y[j] = mul_shoup_lazy(u + two_q - v, w, ws, q);
            }
        }
        t <<= 1;
    }
    for (size_t j = 0; j < n; j++) a[j] = mul_shoup(a[j], p->inv_n, p->inv_n_shoup, q);
}

static void load_tables(prime_tables *out, size_t count, size_t n, const uint64_t *moduli, const uint64_t *ratios,
                        const uint64_t *roots, const uint64_t *iroots, const uint64_t *inv_n) {
    /* roots / iroots: count x 2 x n (powers, then Shoup quotients); inv_n: count x 2 */
    for (size_t i = 0; i < count; i++) {
        out[i].q = moduli[i];
        out[i].r0 = ratios[2 * i];
        out[i].r1 = ratios[2 * i + 1];
        out[i].roots = roots + 2 * i * n;
        out[i].roots_shoup = roots + (2 * i + 1) * n;
        out[i].iroots = iroots + 2 * i * n;
        out[i].iroots_shoup = iroots + (2 * i + 1) * n;
        out[i].inv_n = inv_n[2 * i];
        out[i].inv_n_shoup = inv_n[2 * i + 1];
    }
}

/* The tables of the L + 1 primes a ciphertext of L primes switches over: its own, then the special one. */
static int switch_tables(prime_tables *t, size_t L, size_t K, size_t n, const uint64_t *moduli,
                         const uint64_t *ratios, const uint64_t *roots, const uint64_t *iroots,
                         const uint64_t *inv_n) {
    if (L == 0 || L >= K || L > MAX_DIGITS || n == 0 || (n & (n - 1))) return -1;
    prime_tables all[MAX_DIGITS + 1];
    if (K > MAX_DIGITS + 1) return -1;
    load_tables(all, K, n, moduli, ratios, roots, iroots, inv_n);
    memcpy(t, all, L * sizeof(prime_tables));
    t[L] = all[K - 1];
    return 0;
}

/* c1 (L x n, NTT form) decomposed: out[J][I] (L x (L + 1) x n) is residue J's coefficients reduced modulo
 * prime I (the special prime at I = L), in NTT form. Returns 0, or -1 on bad sizes, -2 out of memory. */
int polyfhe_ks_decompose(const uint64_t *c1, size_t L, size_t K, size_t n, const uint64_t *moduli,
                         const uint64_t *ratios, const uint64_t *roots, const uint64_t *iroots,
                         const uint64_t *inv_n, uint64_t *out) {
    prime_tables t[MAX_DIGITS + 1];
    if (switch_tables(t, L, K, n, moduli, ratios, roots, iroots, inv_n)) return -1;
    uint64_t *coeffs = malloc(n * sizeof(uint64_t));
    if (coeffs == NULL) return -2;
    for (size_t J = 0; J < L; J++) {
        memcpy(coeffs, c1 + J * n, n * sizeof(uint64_t));
        intt(coeffs, n, &t[J]);
        for (size_t I = 0; I <= L; I++) {
            uint64_t *dst = out + (J * (L + 1) + I) * n;
            if (I == J) {
                memcpy(dst, c1 + J * n, n * sizeof(uint64_t));
                continue;
            }
            const uint64_t q = t[I].q;
            const uint64_t r1 = t[I].r1;
            for (size_t j = 0; j < n; j++) dst[j] = reduce64(coeffs[j], q, r1);
            ntt(dst, n, &t[I]);
        }
    }
    free(coeffs);
    return 0;
}

/* One rotation from a decomposition: out (2 x L x n) = (c0[perm], 0) + keyswitch, where digit J of the
 * switched polynomial is decomp[J][I][perm_decomp] (perm_decomp NULL: as it is, the decomposition of an already
 * permuted c1) and keys[J] the step's key for digit J (2 x K x n); inv_special: qk^-1 mod q_i and its Shoup
 * quotient for each data prime i of the key. Returns 0, or -1 on bad sizes, -2 out of memory. */
int polyfhe_ks_rotate(const uint64_t *decomp, const uint64_t *c0, size_t L, size_t K, size_t n,
                      const uint32_t *perm_c0, const uint32_t *perm_decomp, const uint64_t *const *keys,
                      const uint64_t *moduli, const uint64_t *ratios, const uint64_t *roots,
                      const uint64_t *iroots, const uint64_t *inv_n, const uint64_t *inv_special, uint64_t *out) {
    prime_tables t[MAX_DIGITS + 1];
    if (switch_tables(t, L, K, n, moduli, ratios, roots, iroots, inv_n)) return -1;
    uint64_t *acc = malloc(2 * (L + 1) * n * sizeof(uint64_t)); /* the switched pair over L + 1 primes */
    uint64_t *tmp = malloc(n * sizeof(uint64_t));
    if (acc == NULL || tmp == NULL) {
        free(acc);
        free(tmp);
        return -2;
    }
    u128 a0[BLOCK], a1[BLOCK];
    for (size_t I = 0; I <= L; I++) {
        const size_t key_prime = I < L ? I : K - 1;
        const prime_tables *p = &t[I];
        for (size_t start = 0; start < n; start += BLOCK) {
            const size_t m = n - start < BLOCK ? n - start : BLOCK;
            for (size_t c = 0; c < m; c++) a0[c] = a1[c] = 0;
            for (size_t J = 0; J < L; J++) {
                const uint64_t *d = decomp + (J * (L + 1) + I) * n;
                const uint64_t *k0 = keys[J] + key_prime * n + start, *k1 = keys[J] + (K + key_prime) * n + start;
                if (perm_decomp != NULL) {
                    const uint32_t *pj = perm_decomp + start;
                    for (size_t c = 0; c < m; c++) {
                        uint64_t v = d[pj[c]];
                        a0[c] += (u128)v * k0[c];
                        a1[c] += (u128)v * k1[c];
                    }
                } else {
                    const uint64_t *dj = d + start;
                    for (size_t c = 0; c < m; c++) {
                        a0[c] += (u128)dj[c] * k0[c];
                        a1[c] += (u128)dj[c] * k1[c];
                    }
                }
            }
            uint64_t *o0 = acc + I * n + start, *o1 = acc + ((L + 1) + I) * n + start;
            for (size_t c = 0; c < m; c++) {
                o0[c] = reduce128(a0[c], p->q, p->r0, p->r1);
                o1[c] = reduce128(a1[c], p->q, p->r0, p->r1);
            }
        }
    }
    /* divide by the special prime qk, rounding: (acc_i - ((acc_k + qk/2) mod qk - qk/2)) / qk mod q_i */
    const prime_tables *special = &t[L];
    const uint64_t qk = special->q, half = qk >> 1;
    for (size_t poly = 0; poly < 2; poly++) {
        uint64_t *last = acc + (poly * (L + 1) + L) * n;
        intt(last, n, special);
        for (size_t j = 0; j < n; j++) last[j] = add_mod(last[j], half, qk);
        for (size_t i = 0; i < L; i++) {
            const prime_tables *p = &t[i];
            const uint64_t q = p->q, half_i = reduce64(half, q, p->r1);
            for (size_t j = 0; j < n; j++) tmp[j] = sub_mod(reduce64(last[j], q, p->r1), half_i, q);
            ntt(tmp, n, p);
            const uint64_t inv = inv_special[2 * i], inv_shoup = inv_special[2 * i + 1];
            const uint64_t *a = acc + (poly * (L + 1) + i) * n;
            uint64_t *o = out + (poly * L + i) * n;
            const uint64_t *src = c0 + i * n;
            for (size_t j = 0; j < n; j++) {
                uint64_t v = mul_shoup(sub_mod(a[j], tmp[j], q), inv, inv_shoup, q);
                o[j] = poly == 0 ? add_mod(v, src[perm_c0[j]], q) : v;
            }
        }
    }
    free(acc);
    free(tmp);
    return 0;
}

static struct PyModuleDef hoist_module = {
    PyModuleDef_HEAD_INIT, "_hoist", "Hoisted CKKS rotations on SEAL's data, opened with ctypes by polyfhe.engines.seal.hoist.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hoist(void) { return PyModule_Create(&hoist_module); }
