/* The vectorised e^x of the CPU kernels (the AVX-512 and AVX2 decode-attention paths in
 * decode_attention.c, vexp in gemm.c, SiLU in layer.c): e^x = 2^t with t = x log2 e, split
 * as 2^i * 2^f, i the nearest integer and f in [-1/2, 1/2], 2^f by the degree-6 polynomial
 * below. Relative error
 * <= 3e-7 for x in [-5, 0], growing with |x| to ~4e-6 at -87 (t rounded to a float). With
 * i = floor, f in [0, 1), the same polynomial was 5.6e-6 off as f nears 1 (docs/benchmarks/
 * engine.md, "Decode attention on AVX2"). One definition, so the copies cannot drift apart. */
#ifndef STRATA_EXP2_POLY_H
#define STRATA_EXP2_POLY_H

#define STRATA_LOG2E 1.44269504088896341f

/* 2^f by Horner's rule; FMA(a, b, c) = a * b + c and SET1(c) a vector of c, in the caller's
 * vector type. */
#define STRATA_EXP2_POLY(f, FMA, SET1)                                                           \
    FMA(FMA(FMA(FMA(FMA(FMA(SET1(1.535336188319500e-4f), (f), SET1(1.339887440266574e-3f)),    \
                        (f), SET1(9.618437357674640e-3f)),                                      \
                    (f), SET1(5.550332471162809e-2f)),                                          \
                (f), SET1(2.402264791363012e-1f)),                                              \
            (f), SET1(6.931472028550421e-1f)),                                                  \
        (f), SET1(1.f))

#endif
