/* Modular reduction shared by polyfhe's C kernels on SEAL's residues (_kernels.c, _hoist.c). */
#ifndef POLYFHE_MODARITH_H
#define POLYFHE_MODARITH_H

#include <stdint.h>

typedef unsigned __int128 u128;

/* x mod q for a 128-bit x, with ratio = floor(2^128 / q) as (r0 low word, r1 high word); q < 2^61. The
 * quotient estimate is at most 2 below the true one, so two conditional subtractions finish the job. */
static inline uint64_t reduce128(u128 x, uint64_t q, uint64_t r0, uint64_t r1) {
    uint64_t lo = (uint64_t)x, hi = (uint64_t)(x >> 64);
    uint64_t carry = (uint64_t)(((u128)lo * r0) >> 64);
    u128 lo_r1 = (u128)lo * r1;
    uint64_t mid = (uint64_t)lo_r1 + carry;
    uint64_t top = (uint64_t)(lo_r1 >> 64) + (mid < carry);
    u128 hi_r0 = (u128)hi * r0;
    uint64_t sum = mid + (uint64_t)hi_r0;
    uint64_t quotient = hi * r1 + top + (uint64_t)(hi_r0 >> 64) + (sum < mid);
    uint64_t r = lo - quotient * q;
    r = r >= q ? r - q : r;
    return r >= q ? r - q : r;
}

#endif
