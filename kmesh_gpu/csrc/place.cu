// Placement of saved KV segments into paged caches (and the reverse, gather), with the RoPE shift of K.
//
// One launch covers many items (segment -> cache), all layers, K and V. Work unit: one pair of
// head-dim elements (kv, layer, token, head, j), j < D/2. With `rope` on, K pairs j < rd/2 are
// (j, j+rd/2) [neox] or (2j, 2j+1) [GPT-J] and are moved from old to new position in fp32 with a
// fixed operation order (__fmul_rn/__fadd_rn: no contraction) and one rounding; every other pair is
// (2j, 2j+1), copied bit for bit.
#include "common.cuh"

using kmesh::Elem;

template <typename T>
__device__ __forceinline__ void shift_pair(T* p0, T* p1, float x0, float x1, const float* cs, int rd,
                                           long long p_old, long long p_new, int i, float scale) {
    const int half = rd >> 1;
    const float c0 = cs[p_old * rd + i], s0 = cs[p_old * rd + half + i];
    const float c1 = cs[p_new * rd + i], s1 = cs[p_new * rd + half + i];
    const float u0 = __fadd_rn(__fmul_rn(x0, c0), __fmul_rn(x1, s0));
    const float u1 = __fsub_rn(__fmul_rn(x1, c0), __fmul_rn(x0, s0));
    const float z0 = __fsub_rn(__fmul_rn(u0, c1), __fmul_rn(u1, s1));
    const float z1 = __fadd_rn(__fmul_rn(u1, c1), __fmul_rn(u0, s1));
    Elem<T>::store(p0, z0, scale);
    Elem<T>::store(p1, z1, scale);
}

template <typename T>
__global__ void kmesh_place(
    const unsigned long long* __restrict__ kv_ptrs,      // [n_items] byte addresses of (2, L, T_i, H, D)
    const long long* __restrict__ item_tok_start,        // [n_items + 1]
    const long long* __restrict__ tok_item,              // [T_total]
    const long long* __restrict__ slots,                 // [T_total]
    const long long* __restrict__ old_pos,               // [T_total] (rope only)
    const long long* __restrict__ new_pos,               // [T_total] (rope only)
    const unsigned long long* __restrict__ layer_base,   // [n_caches * L] byte address of layer l of cache c
    const long long* __restrict__ item_cache,            // [n_items]
    const long long* __restrict__ k_st,                  // [5] K strides (block, head, token, d) + offset
    const long long* __restrict__ v_st,                  // [5] V likewise
    long long L, long long H, long long D, long long N, long long T_total,
    int gather, int rope, int neox, int rd,
    const float* __restrict__ cos_sin,                   // [positions, rd] fp32 (model-dtype values)
    const float* __restrict__ fp8_table,                 // [256] (fp8 only)
    const float* __restrict__ k_scale)                   // [L]   (fp8 only)
{
    const long long ks[5] = {k_st[0], k_st[1], k_st[2], k_st[3], k_st[4]};
    const long long vs[5] = {v_st[0], v_st[1], v_st[2], v_st[3], v_st[4]};
    const long long half_d = D >> 1;
    const long long total = 2 * L * T_total * H * half_d;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        long long r = idx;
        const long long j = r % half_d;  r /= half_d;
        const long long h = r % H;       r /= H;
        const long long g = r % T_total; r /= T_total;
        const long long l = r % L;
        const int kvsel = (int)(r / L);
        const long long slot = slots[g];
        if (slot < 0) continue;
        const long long item = tok_item[g];
        const long long t = g - item_tok_start[item];
        const long long T_i = item_tok_start[item + 1] - item_tok_start[item];
        T* src = reinterpret_cast<T*>(kv_ptrs[item]) + (((kvsel * L + l) * T_i + t) * H + h) * D;
        const long long* s = kvsel ? vs : ks;
        T* dst = reinterpret_cast<T*>(layer_base[item_cache[item] * L + l])
                 + s[4] + (slot / N) * s[0] + h * s[1] + (slot % N) * s[2];
        const bool rotate = rope && !gather && kvsel == 0 && j < (rd >> 1);
        long long e0 = 2 * j, e1 = 2 * j + 1;
        if (rotate && neox) { e0 = j; e1 = j + (rd >> 1); }
        T* c0 = dst + e0 * s[3];
        T* c1 = dst + e1 * s[3];
        if (gather) { src[e0] = *c0; src[e1] = *c1; continue; }
        if (!rotate) { *c0 = src[e0]; *c1 = src[e1]; continue; }
        const float scale = k_scale ? k_scale[l] : 1.0f;
        const float x0 = Elem<T>::load(src + e0, fp8_table, scale);
        const float x1 = Elem<T>::load(src + e1, fp8_table, scale);
        shift_pair<T>(c0, c1, x0, x1, cos_sin, rd, old_pos[g], new_pos[g], (int)j, scale);
    }
}
