/* bfloat16 <-> float32 in the kernels (a bf16 KV cache, bf16 weights): a bf16 is the high half
 * of a float32's bits, so widening is exact; narrowing rounds to nearest even and makes every NaN
 * 0x7FC0, as torch's c10::BFloat16 does, so a value the kernels write equals torch's
 * ``.to(torch.bfloat16)`` of it bit for bit. */
#ifndef STRATA_BF16_H
#define STRATA_BF16_H

#include <stdint.h>
#include <string.h>

static inline float strata_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t strata_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0; /* NaN */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
