// Placement of saved KV segments into paged caches (and the reverse, gather), with the RoPE shift of K.
//
// One launch covers many items (segment -> cache), all layers, K and V. A *row* is one
// (kv, layer, token): H*D contiguous source elements that land in H runs of D elements in the cache.
// Each row is handled by `threadIdx.x` lanes of one block row (`threadIdx.y`); per-row index math is
// done once, per-element math in 32 bits.
//
// K rows with `rope` on move pairs j < rd/2 — (j, j+rd/2) [neox] or (2j, 2j+1) [GPT-J] — from the old
// to the new position in fp32 with a fixed operation order (__fmul_rn/__fadd_rn: no contraction) and
// one rounding; every other element is copied bit for bit, 16 bytes at a time when `vec16` says that
// every address and stride involved is 16-byte aligned and the cache's d stride is 1.
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
    int gather, int rope, int neox, int rd, int vec16,
    const float* __restrict__ cos_sin,                   // [positions, rd] fp32 (model-dtype values)
    const float* __restrict__ fp8_table,                 // [256] (fp8 only)
    const float* __restrict__ k_scale)                   // [L]
{
    const long long rows = 2 * L * T_total;
    const int HD = (int)(H * D);
    for (long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y; row < rows;
         row += (long long)gridDim.x * blockDim.y) {
        const long long g = row % T_total;
        const long long lk = row / T_total;          // kvsel * L + l
        const long long l = lk % L;
        const int kvsel = (int)(lk / L);
        const long long slot = slots[g];
        if (slot < 0) continue;
        const long long item = tok_item[g];
        const long long t = g - item_tok_start[item];
        const long long T_i = item_tok_start[item + 1] - item_tok_start[item];
        T* src = reinterpret_cast<T*>(kv_ptrs[item]) + ((kvsel * L + l) * T_i + t) * HD;
        const long long* s = kvsel ? v_st : k_st;
        const long long s_head = s[1], s_d = s[3];
        T* dst = reinterpret_cast<T*>(layer_base[item_cache[item] * L + l]) + s[4] + (slot / N) * s[0]
                 + (slot % N) * s[2];
        const bool rotate = rope && !gather && kvsel == 0;
        const int Di = (int)D;
        if (!rotate && vec16) {
            // 16-byte copies: D*sizeof(T) is a multiple of 16, d stride 1, all bases aligned.
            const int per_head = Di * (int)sizeof(T) / 16;
            for (int p = threadIdx.x; p < (int)H * per_head; p += blockDim.x) {
                const int h = p / per_head, q = p - h * per_head;
                uint4* a = reinterpret_cast<uint4*>(src + h * Di) + q;
                uint4* b = reinterpret_cast<uint4*>(dst + h * s_head) + q;
                if (gather) *a = *b; else *b = *a;
            }
            continue;
        }
        const int half_d = Di >> 1, half_rd = rd >> 1;
        const float scale = k_scale[l];
        const long long po = rotate ? old_pos[g] : 0, pn = rotate ? new_pos[g] : 0;
        for (int p = threadIdx.x; p < (int)H * half_d; p += blockDim.x) {
            const int h = p / half_d, j = p - h * half_d;
            const bool pair_rot = rotate && j < half_rd;
            int e0 = 2 * j, e1 = 2 * j + 1;
            if (pair_rot && neox) { e0 = j; e1 = j + half_rd; }
            T* a0 = src + h * Di + e0;
            T* a1 = src + h * Di + e1;
            T* c0 = dst + h * s_head + e0 * s_d;
            T* c1 = dst + h * s_head + e1 * s_d;
            if (gather) { *a0 = *c0; *a1 = *c1; continue; }
            if (!pair_rot) { *c0 = *a0; *c1 = *a1; continue; }
            const float x0 = Elem<T>::load(a0, fp8_table, scale);
            const float x1 = Elem<T>::load(a1, fp8_table, scale);
            shift_pair<T>(c0, c1, x0, x1, cos_sin, rd, po, pn, j, scale);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Vectorised variant: each lane moves 8 consecutive elements of one head as two 4-element vectors.
// Preconditions (checked on the host): D % 8 == 0, rd % 8 == 0, d stride 1 for K and V, and every
// base, stride and head run aligned to 4 * sizeof(T) bytes. Lane c of a head covers elements
// [8c, 8c+8); with the shift on, lanes c < rd/8 of K rows rotate 4 pairs each:
//   neox : pairs (4c+i, 4c+i+rd/2), i < 4 — two vectors rd/2 apart;
//   GPT-J: pairs (8c+2i, 8c+2i+1)      — two adjacent vectors.
template <typename T> struct Vec4;
template <> struct Vec4<float> { typedef uint4 type; };
template <> struct Vec4<__half> { typedef uint2 type; };
template <> struct Vec4<__nv_bfloat16> { typedef uint2 type; };
template <> struct Vec4<unsigned char> { typedef unsigned int type; };

// Per-token table rows (int64, each T_total long) read by kmesh_place_vec.
enum TokRow { TOK_SLOT = 0, TOK_SRC, TOK_SRC_STEP, TOK_DST_K, TOK_DST_V, TOK_CACHE, TOK_OLD, TOK_NEW, TOK_ROWS };

template <typename T, int PER, int LPT>
__global__ void kmesh_place_vec(
    const long long* __restrict__ tok,                   // [TOK_ROWS, T_total] (see TokRow)
    const unsigned long long* __restrict__ layer_base,   // [n_caches * L] byte address of layer l of cache c
    long long L, long long H, long long D, long long T_total, long long head_k, long long head_v,
    int gather, int rope, int neox, int rd,
    const float* __restrict__ cos_sin, const float* __restrict__ fp8_table, const float* __restrict__ k_scale)
{
    // grid.x = (K|V, group of LPT layers), the fast grid axis, so the blocks of one token group run
    // close together and share its table rows and cos/sin rows in L2; grid.y strides over token
    // groups; threadIdx.y picks a token. Each lane moves PER chunks of 8 elements in each of LPT
    // layers, issuing all LPT*PER loads before any store: the token's table entries are read once
    // for LPT layers and several memory requests are in flight per thread.
    typedef typename Vec4<T>::type V4;
    const int Li = (int)L, groups = (Li + LPT - 1) / LPT;
    const int kvsel = (int)blockIdx.x >= groups ? 1 : 0;
    const int l0 = ((int)blockIdx.x - kvsel * groups) * LPT;
    const int Di = (int)D, chunks_per_head = Di >> 3, chunks = (int)H * chunks_per_head;
    const long long s_head = kvsel ? head_v : head_k;
    const bool rotate = rope && !gather && kvsel == 0;
    const int half = rd >> 1, rot_chunks = rd >> 3;
    const long long* slot_row = tok + TOK_SLOT * T_total;
    for (long long g = (long long)blockIdx.y * blockDim.y + threadIdx.y; g < T_total;
         g += (long long)gridDim.y * blockDim.y) {
        if (slot_row[g] < 0) continue;
        const long long src0 = tok[TOK_SRC * T_total + g], step = tok[TOK_SRC_STEP * T_total + g];
        const long long dst_off = tok[(kvsel ? TOK_DST_V : TOK_DST_K) * T_total + g];
        const long long cache_l = tok[TOK_CACHE * T_total + g];
        const float* cs_old = rotate ? cos_sin + tok[TOK_OLD * T_total + g] * rd : cos_sin;
        const float* cs_new = rotate ? cos_sin + tok[TOK_NEW * T_total + g] * rd : cos_sin;
        for (int base = 0; base < chunks; base += PER * blockDim.x) {
            V4 in0[LPT][PER], in1[LPT][PER];
            T* srcs[LPT];
            T* dsts[LPT];
            int e0[PER], e1[PER], hs[PER];
            bool rot[PER], live[PER];
#pragma unroll
            for (int k = 0; k < PER; ++k) {
                const int c = base + threadIdx.x + k * blockDim.x;
                live[k] = c < chunks;
                const int h = live[k] ? c / chunks_per_head : 0;
                const int cc = live[k] ? c - h * chunks_per_head : 0;
                rot[k] = rotate && cc < rot_chunks;
                if (!rotate) {  // a plain row: chunk cc = 4 elements from each half, so that
                    e0[k] = 4 * cc;  // neighbouring lanes read neighbouring 8-byte pieces
                    e1[k] = 4 * cc + (Di >> 1);
                } else {
                    e0[k] = (rot[k] && neox) ? 4 * cc : 8 * cc;
                    e1[k] = (rot[k] && neox) ? 4 * cc + half : 8 * cc + 4;
                }
                hs[k] = h;
            }
#pragma unroll
            for (int j = 0; j < LPT; ++j) {  // load phase: every layer and chunk of this lane
                const int l = l0 + j;
                if (l >= Li) break;
                srcs[j] = reinterpret_cast<T*>(src0 + (long long)(kvsel * Li + l) * step);
                dsts[j] = reinterpret_cast<T*>(layer_base[cache_l + l]) + dst_off;
#pragma unroll
                for (int k = 0; k < PER; ++k) {
                    if (!live[k]) continue;
                    const T* from = gather ? dsts[j] + hs[k] * s_head : srcs[j] + hs[k] * Di;
                    in0[j][k] = *reinterpret_cast<const V4*>(from + e0[k]);
                    in1[j][k] = *reinterpret_cast<const V4*>(from + e1[k]);
                }
            }
#pragma unroll
            for (int k = 0; k < PER; ++k) {  // compute + store phase, chunk by chunk
                if (!live[k]) continue;
                float cpa[4], spa[4], cqa[4], sqa[4];
                if (rot[k]) {  // this token's cos/sin for the chunk's 4 pairs: loaded once for all LPT layers
                    const int i0 = neox ? e0[k] : e0[k] >> 1;  // first pair index of this chunk
                    const float4 cp = *reinterpret_cast<const float4*>(cs_old + i0);
                    const float4 sp = *reinterpret_cast<const float4*>(cs_old + half + i0);
                    const float4 cq = *reinterpret_cast<const float4*>(cs_new + i0);
                    const float4 sq = *reinterpret_cast<const float4*>(cs_new + half + i0);
                    cpa[0] = cp.x; cpa[1] = cp.y; cpa[2] = cp.z; cpa[3] = cp.w;
                    spa[0] = sp.x; spa[1] = sp.y; spa[2] = sp.z; spa[3] = sp.w;
                    cqa[0] = cq.x; cqa[1] = cq.y; cqa[2] = cq.z; cqa[3] = cq.w;
                    sqa[0] = sq.x; sqa[1] = sq.y; sqa[2] = sq.z; sqa[3] = sq.w;
                }
#pragma unroll
                for (int j = 0; j < LPT; ++j) {
                    const int l = l0 + j;
                    if (l >= Li) break;
                    T* to = gather ? srcs[j] + hs[k] * Di : dsts[j] + hs[k] * s_head;
                    if (!rot[k]) {
                        *reinterpret_cast<V4*>(to + e0[k]) = in0[j][k];
                        *reinterpret_cast<V4*>(to + e1[k]) = in1[j][k];
                        continue;
                    }
                    const float scale = k_scale[l];
                    const T* x0 = reinterpret_cast<const T*>(&in0[j][k]);
                    const T* x1 = reinterpret_cast<const T*>(&in1[j][k]);
                    V4 out0, out1;
                    T* y0 = reinterpret_cast<T*>(&out0);
                    T* y1 = reinterpret_cast<T*>(&out1);
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        // neox: pair q = (x0[q], x1[q]); GPT-J: pair q = elements (2q, 2q+1) of x0|x1
                        const T* pe = neox ? x0 + q : (q < 2 ? x0 + 2 * q : x1 + 2 * (q - 2));
                        const T* po = neox ? x1 + q : pe + 1;
                        const float u = Elem<T>::load(pe, fp8_table, scale);
                        const float v = Elem<T>::load(po, fp8_table, scale);
                        const float u0 = __fadd_rn(__fmul_rn(u, cpa[q]), __fmul_rn(v, spa[q]));
                        const float u1 = __fsub_rn(__fmul_rn(v, cpa[q]), __fmul_rn(u, spa[q]));
                        T* oe = neox ? y0 + q : (q < 2 ? y0 + 2 * q : y1 + 2 * (q - 2));
                        T* oo = neox ? y1 + q : oe + 1;
                        Elem<T>::store(oe, __fsub_rn(__fmul_rn(u0, cqa[q]), __fmul_rn(u1, sqa[q])), scale);
                        Elem<T>::store(oo, __fadd_rn(__fmul_rn(u1, cqa[q]), __fmul_rn(u0, sqa[q])), scale);
                    }
                    *reinterpret_cast<V4*>(to + e0[k]) = out0;
                    *reinterpret_cast<V4*>(to + e1[k]) = out1;
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Run kernel: the fast path when every access can be a 16-byte vector (d stride 1, everything
// 16-byte aligned). A *run* is up to `cap` consecutive tokens of one item that land in consecutive
// slots of one cache block; its source rows (len * H * D elements per K|V and layer) are contiguous.
// One warp is one *unit*: a run and a group of layers, for K or V (KVF = 0; units numbered with K|V
// slowest) or for both, K then V layer by layer (KVF = 1: a token's K and V are written together,
// which suits layouts that keep them side by side).
//
// Shifted K rows are moved by *pair groups*: a group is (token, first pair) covering CNT pairs —
// neox: the vector at e0 and its partner at e0 + rd/2, GPT-J: one vector of adjacent pairs. A lane
// loads the cos/sin of its G groups once into registers and reuses them for every layer and head of
// the unit, and moves both vectors of a pair itself: no shuffles, no shared memory. The host picks
// `cap` so that a run has at most 32*G groups. Everything else (V, K without shift, K dims past rd,
// gather) is copied as consecutive vectors, VPL per lane in flight.
enum RunCol { RUN_TOK0 = 0, RUN_LEN, RUN_SRC, RUN_STEP, RUN_DST_K, RUN_DST_V, RUN_CACHE, RUN_COLS };

template <int CNT>
__device__ __forceinline__ void load_floats(float (&out)[CNT], const float* __restrict__ p) {
    if constexpr (CNT % 4 == 0) {
#pragma unroll
        for (int i = 0; i < CNT; i += 4) {
            const float4 f = __ldg(reinterpret_cast<const float4*>(p + i));
            out[i] = f.x; out[i + 1] = f.y; out[i + 2] = f.z; out[i + 3] = f.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < CNT; i += 2) {
            const float2 f = __ldg(reinterpret_cast<const float2*>(p + i));
            out[i] = f.x; out[i + 1] = f.y;
        }
    }
}

// One layer of a run's rows as consecutive vectors (elements e >= skip_e of each head only).
template <typename T, int VPL>
__device__ __forceinline__ void rows_layer(T* __restrict__ sp, T* __restrict__ dl, int nvec, int vpt, int vph,
                                           int s_head, int s_tok, int lane, int skip_e, int gather) {
    constexpr int EPV = 16 / (int)sizeof(T);
    for (int base = 0; base < nvec; base += 32 * VPL) {
        uint4 v[VPL];
        int off[VPL];
#pragma unroll
        for (int k = 0; k < VPL; ++k) {  // every load before any store
            const int i = base + lane + 32 * k;
            const int n = i / vpt, rem = i - n * vpt, h = rem / vph, e0 = (rem - h * vph) * EPV;
            off[k] = (i < nvec && e0 >= skip_e) ? h * s_head + n * s_tok + e0 : -1;
            if (off[k] >= 0) v[k] = gather ? *reinterpret_cast<const uint4*>(dl + off[k])
                                           : reinterpret_cast<const uint4*>(sp)[i];
        }
#pragma unroll
        for (int k = 0; k < VPL; ++k) {
            if (off[k] < 0) continue;
            if (gather) reinterpret_cast<uint4*>(sp)[base + lane + 32 * k] = v[k];
            else *reinterpret_cast<uint4*>(dl + off[k]) = v[k];
        }
    }
}

template <typename T, bool NEOX>
__device__ __forceinline__ void shift_pairs(uint4& a, uint4& b, const float (&c)[4][NEOX ? 16 / sizeof(T) : 8 / sizeof(T)],
                                            const float* fp8_table, float scale) {
    constexpr int CNT = NEOX ? 16 / (int)sizeof(T) : 8 / (int)sizeof(T);
    T* x = reinterpret_cast<T*>(&a);
    T* y = reinterpret_cast<T*>(&b);
#pragma unroll
    for (int q = 0; q < CNT; ++q) {  // pair q: (x[q], y[q]) for neox, (x[2q], x[2q+1]) for GPT-J
        T* p0 = NEOX ? x + q : x + 2 * q;
        T* p1 = NEOX ? y + q : x + 2 * q + 1;
        const float x0 = Elem<T>::load(p0, fp8_table, scale), x1 = Elem<T>::load(p1, fp8_table, scale);
        const float u0 = __fadd_rn(__fmul_rn(x0, c[0][q]), __fmul_rn(x1, c[1][q]));
        const float u1 = __fsub_rn(__fmul_rn(x1, c[0][q]), __fmul_rn(x0, c[1][q]));
        Elem<T>::store(p0, __fsub_rn(__fmul_rn(u0, c[2][q]), __fmul_rn(u1, c[3][q])), scale);
        Elem<T>::store(p1, __fadd_rn(__fmul_rn(u1, c[2][q]), __fmul_rn(u0, c[3][q])), scale);
    }
}

// A lane's pair groups of a run: cos/sin (old and new position) and offsets, loaded once per unit.
template <typename T, bool NEOX, int G>
struct PairGroups {
    static constexpr int EPV = 16 / (int)sizeof(T);
    static constexpr int CNT = NEOX ? EPV : EPV / 2;
    float cs[G][4][CNT];  // cos_old, sin_old, cos_new, sin_new
    int so[G], dof[G];    // offsets inside a run: the host checks that they fit in 32 bits
    bool gl[G];

    __device__ __forceinline__ void load(int len, int H, int D, int s_tok, int rd, int lane,
                                         const long long* __restrict__ pos, long long T_total, long long tok0,
                                         const float* __restrict__ cos_sin) {
        const int half = rd >> 1, per_tok = NEOX ? half / EPV : rd / EPV, ngr = len * per_tok;
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const int gi = lane + 32 * g;
            gl[g] = gi < ngr;
            const int n = gl[g] ? gi / per_tok : 0, e0 = (gi - n * per_tok) * EPV;
            so[g] = n * H * D + e0;
            dof[g] = n * s_tok + e0;
            if (gl[g]) {
                const int p0 = NEOX ? e0 : e0 >> 1;
                const float* po = cos_sin + pos[tok0 + n] * rd + p0;
                const float* pn = cos_sin + pos[T_total + tok0 + n] * rd + p0;
                load_floats<CNT>(cs[g][0], po);
                load_floats<CNT>(cs[g][1], po + half);
                load_floats<CNT>(cs[g][2], pn);
                load_floats<CNT>(cs[g][3], pn + half);
            }
        }
    }

    // One layer of shifted K: HB heads' loads in flight before their stores.
    template <int HB>
    __device__ __forceinline__ void shift_layer(const T* __restrict__ sp, T* __restrict__ dl, int H, int D, int s_head,
                                                int half, const float* __restrict__ fp8_table, float scale) const {
        for (int h0 = 0; h0 < H; h0 += HB) {
            uint4 a[G][HB], b[G][HB];
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int hh = 0; hh < HB; ++hh)
                    if (gl[g] && h0 + hh < H) {
                        const T* s = sp + so[g] + (h0 + hh) * D;
                        a[g][hh] = *reinterpret_cast<const uint4*>(s);
                        if (NEOX) b[g][hh] = *reinterpret_cast<const uint4*>(s + half);
                    }
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int hh = 0; hh < HB; ++hh)
                    if (gl[g] && h0 + hh < H) {
                        shift_pairs<T, NEOX>(a[g][hh], b[g][hh], cs[g], fp8_table, scale);
                        T* d = dl + dof[g] + (h0 + hh) * s_head;
                        *reinterpret_cast<uint4*>(d) = a[g][hh];
                        if (NEOX) *reinterpret_cast<uint4*>(d + half) = b[g][hh];
                    }
        }
    }
};

template <typename T, bool NEOX, int G, int HB, int VPL, int KVF>
__device__ __forceinline__ void run_unit(int kvsel, T* src, long long step, const unsigned long long* __restrict__ layer_base,
                                         long long cache_l, long long dst_k, long long dst_v, int l0, int lend, int L,
                                         int len, int H, int D, int head_k, int head_v, int tok_k, int tok_v,
                                         int gather, bool rope, int rd, int lane, const long long* __restrict__ pos,
                                         long long T_total, long long tok0, const float* __restrict__ cos_sin,
                                         const float* __restrict__ fp8_table, const float* __restrict__ k_scale) {
    constexpr int EPV = 16 / (int)sizeof(T);
    const int vph = D / EPV, vpt = H * vph, nvec = len * vpt;
    const bool do_k = KVF || kvsel == 0, do_v = KVF || kvsel == 1;
    const bool shift = rope && !gather && do_k;
    PairGroups<T, NEOX, G> pg;
    if (shift) pg.load(len, H, D, tok_k, rd, lane, pos, T_total, tok0, cos_sin);
    T* vsrc = src + (long long)L * step;
    for (int l = l0; l < lend; ++l) {
        T* base = reinterpret_cast<T*>(layer_base[cache_l + l]);
        if (do_k) {
            if (shift) {
                pg.template shift_layer<HB>(src + l * step, base + dst_k, H, D, head_k, rd >> 1, fp8_table, k_scale[l]);
                if (rd < D)
                    rows_layer<T, VPL>(src + l * step, base + dst_k, nvec, vpt, vph, head_k, tok_k, lane, rd, 0);
            } else {
                rows_layer<T, VPL>(src + l * step, base + dst_k, nvec, vpt, vph, head_k, tok_k, lane, 0, gather);
            }
        }
        if (do_v) rows_layer<T, VPL>(vsrc + l * step, base + dst_v, nvec, vpt, vph, head_v, tok_v, lane, 0, gather);
    }
}

template <typename T, int G, int HB, int VPL, int KVF>
__global__ void kmesh_place_runs(
    const long long* __restrict__ runs,                  // [R, RUN_COLS] (see RunCol)
    const long long* __restrict__ pos,                   // [2, T_total] old | new positions (rope only)
    const unsigned long long* __restrict__ layer_base,   // [n_caches * L] byte address of layer l of cache c
    long long R, long long T_total, int L, int LG, int H, int D,
    int head_k, int head_v, int tok_k, int tok_v,
    int gather, int rope, int neox, int rd,
    const float* __restrict__ cos_sin, const float* __restrict__ fp8_table, const float* __restrict__ k_scale)
{
    const int lane = threadIdx.x & 31;
    const long long unit = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long per_kv = R * ((L + LG - 1) / LG);
    const int kvsel = KVF ? 0 : (int)(unit / per_kv);
    if (unit >= (KVF ? 1 : 2) * per_kv) return;  // whole warps leave together
    const long long rest = unit - kvsel * per_kv, r = rest % R;
    const int l0 = (int)(rest / R) * LG, lend = min(L, l0 + LG);
    const long long* row = runs + r * RUN_COLS;
    const long long step = row[RUN_STEP] / (long long)sizeof(T);  // elements per (K|V, layer) plane
    T* src = reinterpret_cast<T*>(row[RUN_SRC]);
    if (neox)
        run_unit<T, true, G, HB, VPL, KVF>(kvsel, src, step, layer_base, row[RUN_CACHE], row[RUN_DST_K], row[RUN_DST_V],
                                           l0, lend, L, (int)row[RUN_LEN], H, D, head_k, head_v, tok_k, tok_v, gather,
                                           rope != 0, rd, lane, pos, T_total, row[RUN_TOK0], cos_sin, fp8_table, k_scale);
    else
        run_unit<T, false, G, HB, VPL, KVF>(kvsel, src, step, layer_base, row[RUN_CACHE], row[RUN_DST_K], row[RUN_DST_V],
                                            l0, lend, L, (int)row[RUN_LEN], H, D, head_k, head_v, tok_k, tok_v, gather,
                                            rope != 0, rd, lane, pos, T_total, row[RUN_TOK0], cos_sin, fp8_table, k_scale);
}
