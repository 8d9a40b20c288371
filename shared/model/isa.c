/* Which of the kernels' code paths this library was compiled with (`build_kernels.py` builds one
 * library per ISA variant; the tests check each reports the variant it was built as). The same
 * macros pick the paths in decode_attention.c, gemm.c, gemm_int8.c and gemm_bf16.c. */
#include "kernels.h"

const char *strata_kernel_isa(void) {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512bf16";
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return "avx512vnni";
#elif defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}
