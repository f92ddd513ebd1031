// Shared device helpers for KMesh kernels. Framework-free: raw pointers, int64 index math.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>


namespace kmesh {

// Element <-> fp32 conversions; fp32 -> narrow type rounds to nearest even.
template <typename T> struct Elem;

template <> struct Elem<float> {
    static __device__ __forceinline__ float load(const float* p, const float*, float) { return *p; }
    static __device__ __forceinline__ void store(float* p, float x, float) { *p = x; }
};
template <> struct Elem<__half> {
    static __device__ __forceinline__ float load(const __half* p, const float*, float) { return __half2float(*p); }
    static __device__ __forceinline__ void store(__half* p, float x, float) { *p = __float2half_rn(x); }
};
template <> struct Elem<__nv_bfloat16> {
    static __device__ __forceinline__ float load(const __nv_bfloat16* p, const float*, float) {
        return __bfloat162float(*p);
    }
    static __device__ __forceinline__ void store(__nv_bfloat16* p, float x, float) { *p = __float2bfloat16_rn(x); }
};

// fp8 e4m3 (OCP "fn" variant: no infinities, 0x7f/0xff NaN, max 448) held as uint8 bits.
__device__ __forceinline__ unsigned char fp8_e4m3_encode(float x) {
    unsigned int bits = __float_as_uint(x);
    unsigned int sign = (bits >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return (unsigned char)(sign | 0x7fu);
    if (a >= 448.0f) return (unsigned char)(sign | 0x7eu);         // saturate (the caller clamps too)
    if (a < 0.015625f) {                                      // below 2^-6: subnormal step 2^-9
        float m = rintf(__fmul_rn(a, 512.0f));                // exact scaling, round half even
        return (unsigned char)(sign | (unsigned int)m);
    }
    unsigned int ab = bits & 0x7fffffffu;
    unsigned int exp = (ab >> 23) - 127u + 7u;                    // biased e4m3 exponent, 1..15
    unsigned int man = ab & 0x7fffffu;
    unsigned int keep = man >> 20, rem = man & 0xfffffu;
    unsigned int q = (exp << 3) | keep;
    if (rem > 0x80000u || (rem == 0x80000u && (keep & 1u))) q += 1u;
    if (q > 0x7eu) q = 0x7eu;
    return (unsigned char)(sign | q);
}

template <> struct Elem<unsigned char> {
    // fp8 e4m3: decode through a 256-entry fp32 table, then the per-tensor scale.
    static __device__ __forceinline__ float load(const unsigned char* p, const float* table, float scale) {
        return __fmul_rn(table[*p], scale);
    }
    static __device__ __forceinline__ void store(unsigned char* p, float x, float scale) {
        float y = __fdiv_rn(x, scale);
        if (y == y) y = fminf(fmaxf(y, -448.0f), 448.0f);  // fmaxf(NaN, -448) is -448: NaN stays NaN (torch)
        *p = fp8_e4m3_encode(y);
    }
};

}  // namespace kmesh
