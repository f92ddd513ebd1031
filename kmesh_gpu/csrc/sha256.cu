// Batched SHA-256 (FIPS 180-4) and the levels of the kmesh-tree-sha256/v1 digest (docs/tree-sha256.md).
//
// Framework-free: raw byte pointers and int64 offsets. One thread hashes one whole message; a launch
// hashes many independent messages. SHA-256 of one message is a serial chain of 64-byte blocks, so the
// parallelism comes from the number of messages: the tree format bounds every chain to
// leaf_size/64 + 1 blocks and makes every tree level one launch.
//
// Kernels (all extern "C", launched with 1-D grids of SHA256_THREADS threads):
//   kmesh_sha256_batched      message i = data[offsets[i] : offsets[i] + lengths[i]], digest -> out[32 i]
//   kmesh_sha256_tree_fused   whole kmesh-tree-sha256/v1 trees of many objects in ONE launch: a thread
//                             per leaf; the last child to finish a node hashes that node, and so on
//                             up to the top, whose thread hashes the root record (the CuPy fast path)
//   kmesh_sha256_tree_level   messages described per object (one tree level of many objects): the
//                             path of large batches, where per-level launches keep more warps busy

typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define SHA256_THREADS 128

__constant__ u32 kSha256K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};

__device__ __forceinline__ u32 rotr(u32 x, u32 n) { return __funnelshift_r(x, x, n); }

// Big-endian word from little-endian memory order: one PRMT.
__device__ __forceinline__ u32 bswap32(u32 x) { return __byte_perm(x, 0u, 0x0123u); }

__device__ __forceinline__ void sha256_init(u32 st[8]) {
    st[0] = 0x6a09e667u; st[1] = 0xbb67ae85u; st[2] = 0x3c6ef372u; st[3] = 0xa54ff53au;
    st[4] = 0x510e527fu; st[5] = 0x9b05688cu; st[6] = 0x1f83d9abu; st[7] = 0x5be0cd19u;
}

// One compression. Fully unrolled so that the 16-word rolling schedule and the eight working
// variables live in registers (no local-memory arrays); `w` is consumed.
__device__ __forceinline__ void sha256_compress(u32 st[8], u32 w[16]) {
    u32 a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
#pragma unroll
    for (int r = 0; r < 64; ++r) {
        u32 wr;
        if (r < 16) {
            wr = w[r];
        } else {
            const u32 w15 = w[(r - 15) & 15], w2 = w[(r - 2) & 15];
            const u32 s0 = rotr(w15, 7) ^ rotr(w15, 18) ^ (w15 >> 3);
            const u32 s1 = rotr(w2, 17) ^ rotr(w2, 19) ^ (w2 >> 10);
            wr = w[r & 15] + s0 + w[(r - 7) & 15] + s1;
            w[r & 15] = wr;
        }
        const u32 S1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
        const u32 ch = (e & f) ^ (~e & g);
        const u32 t1 = h + S1 + ch + kSha256K[r] + wr;
        const u32 S0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
        const u32 maj = (a & b) | (c & (a | b));
        const u32 t2 = S0 + maj;
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d;
    st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

__device__ __forceinline__ void words_from_vec(u32 w[16], const uint4& v0, const uint4& v1,
                                               const uint4& v2, const uint4& v3) {
    w[0] = bswap32(v0.x);  w[1] = bswap32(v0.y);  w[2] = bswap32(v0.z);  w[3] = bswap32(v0.w);
    w[4] = bswap32(v1.x);  w[5] = bswap32(v1.y);  w[6] = bswap32(v1.z);  w[7] = bswap32(v1.w);
    w[8] = bswap32(v2.x);  w[9] = bswap32(v2.y);  w[10] = bswap32(v2.z); w[11] = bswap32(v2.w);
    w[12] = bswap32(v3.x); w[13] = bswap32(v3.y); w[14] = bswap32(v3.z); w[15] = bswap32(v3.w);
}

// The full 64-byte blocks of a message. Two load paths by alignment of the message start:
// 16 bytes (the common case: tensors and tree levels are aligned), with the next block's four 16-byte
// loads issued before the current block is compressed; any other alignment, aligned word loads
// realigned with one PRMT per word. That path reads the aligned word holding the block's last byte
// whole, which never leaves the allocation (allocations are at least 4-byte aligned); at offset 0 mod 4
// it reads no word past the block. Each path holds one inlined copy of the compression (code size).
__device__ __forceinline__ void sha256_full_blocks(u32 st[8], const u8* __restrict__ msg, i64 nblocks) {
    if (nblocks <= 0) return;
    const u64 addr = (u64)msg;
    if ((addr & 15u) == 0) {
        const uint4* p = (const uint4*)msg;
        uint4 v0 = __ldg(p), v1 = __ldg(p + 1), v2 = __ldg(p + 2), v3 = __ldg(p + 3);
        for (i64 blk = 0; blk < nblocks; ++blk) {
            u32 w[16];
            words_from_vec(w, v0, v1, v2, v3);
            if (blk + 1 < nblocks) {
                const uint4* q = p + 4 * (blk + 1);
                v0 = __ldg(q); v1 = __ldg(q + 1); v2 = __ldg(q + 2); v3 = __ldg(q + 3);
            }
            sha256_compress(st, w);
        }
    } else {
        const u32 s = (u32)(addr & 3u);
        // Result byte 0 (least significant) is source byte s+3, ..., byte 3 is source byte s: the
        // big-endian word starting at byte s of the pair (x, y). At s = 0 this is a byte swap of x.
        const u32 sel = (s + 3u) | ((s + 2u) << 4) | ((s + 1u) << 8) | (s << 12);
        const u32* p = (const u32*)(addr & ~(u64)3);
        for (i64 blk = 0; blk < nblocks; ++blk, p += 16) {
            u32 w[16];
            u32 x = __ldg(p);
#pragma unroll
            for (int k = 0; k < 16; ++k) {
                const u32 y = (k < 15 || s != 0u) ? __ldg(p + k + 1) : 0u;
                w[k] = __byte_perm(x, y, sel);
                x = y;
            }
            sha256_compress(st, w);
        }
    }
}

// The final block(s): the 0..63 trailing bytes, the 0x80 marker and the 64-bit bit length; a second
// block when fewer than 8 bytes are left for the length. One compression site (code size).
__device__ __forceinline__ void sha256_tail(u32 st[8], const u8* __restrict__ tail, int rem, i64 len) {
    u32 w[16];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        u32 x = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i = 4 * k + b;
            const u32 byte = (i < rem) ? (u32)tail[i] : (i == rem ? 0x80u : 0u);
            x |= byte << (24 - 8 * b);
        }
        w[k] = x;
    }
    const u64 bits = (u64)len << 3;
    const int passes = rem >= 56 ? 2 : 1;
#pragma unroll 1
    for (int pass = 0; pass < passes; ++pass) {
        if (pass == passes - 1) {
            if (pass == 1) {
#pragma unroll
                for (int k = 0; k < 14; ++k) w[k] = 0;
            }
            w[14] = (u32)(bits >> 32);
            w[15] = (u32)bits;
        }
        sha256_compress(st, w);
    }
}

__device__ __forceinline__ void store_digest(u8* __restrict__ out, const u32 st[8]) {
    if (((u64)out & 15u) == 0) {
        uint4* o = (uint4*)out;
        o[0] = make_uint4(bswap32(st[0]), bswap32(st[1]), bswap32(st[2]), bswap32(st[3]));
        o[1] = make_uint4(bswap32(st[4]), bswap32(st[5]), bswap32(st[6]), bswap32(st[7]));
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            out[4 * k + 0] = (u8)(st[k] >> 24);
            out[4 * k + 1] = (u8)(st[k] >> 16);
            out[4 * k + 2] = (u8)(st[k] >> 8);
            out[4 * k + 3] = (u8)st[k];
        }
    }
}

__device__ __forceinline__ void sha256_message(const u8* __restrict__ msg, i64 len, u8* __restrict__ out) {
    u32 st[8];
    sha256_init(st);
    const i64 nblocks = len >> 6;
    sha256_full_blocks(st, msg, nblocks);
    sha256_tail(st, msg + (nblocks << 6), (int)(len & 63), len);
    store_digest(out, st);
}

extern "C" __global__ void __launch_bounds__(SHA256_THREADS)
kmesh_sha256_batched(const u8* __restrict__ data,       // [M] bytes
                     const i64* __restrict__ offsets,   // [n] byte offset of message i in data
                     const i64* __restrict__ lengths,   // [n] byte length of message i
                     u8* __restrict__ out,              // [n, 32] digests
                     i64 n)
{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    sha256_message(data + offsets[i], lengths[i], out + 32 * i);
}

// The last object o in [0, n) with starts[o] <= i (starts ascending, starts[0] <= i): binary search.
__device__ __forceinline__ i64 last_at_or_below(const i64* __restrict__ starts, i64 n, i64 i) {
    i64 lo = 0, hi = n - 1;
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if (__ldg(starts + mid) <= i) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// One tree level of many objects. `table` holds four int64 columns for the n_obj objects that still
// have messages at this level:
//   starts[n_obj + 1]  first message index of each object (prefix sums; starts[n_obj] = n_msgs)
//   src_off[n_obj]     byte offset of the object's level input in `src`
//   src_bytes[n_obj]   byte length of that input (payload length at level 0, 32 x digests above)
//   out_off[n_obj]     byte offset in `out` of the object's first digest (its others follow, 32 apart)
// Message j of object o is src[src_off + j*piece : + min(piece, src_bytes - j*piece)].
extern "C" __global__ void __launch_bounds__(SHA256_THREADS)
kmesh_sha256_tree_level(const u8* __restrict__ src, i64 piece, const i64* __restrict__ table,
                        i64 n_obj, i64 n_msgs, u8* __restrict__ out)
{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_msgs) return;
    const i64* starts = table;
    const i64* src_off = table + n_obj + 1;
    const i64* src_bytes = src_off + n_obj;
    const i64* out_off = src_bytes + n_obj;
    const i64 lo = last_at_or_below(starts, n_obj, i);
    const i64 j = i - __ldg(starts + lo);
    const i64 begin = j * piece;
    const i64 left = __ldg(src_bytes + lo) - begin;
    const i64 len = left < piece ? left : piece;
    sha256_message(src + __ldg(src_off + lo) + begin, len, out + __ldg(out_off + lo) + 32 * j);
}

// ---------------------------------------------------------------------------------------------
// The whole tree in one launch.
//
// One thread per leaf of every object. A thread hashes its leaf, stores the digest in `scratch` (slot
// `leaf_start[o] + j`), makes it visible (__threadfence) and counts itself in its parent's counter
// (atomicAdd). The thread that brings a counter to its child count is the last of the siblings: it
// hashes the parent over the children digests (read from L2 with ld.global.cg: other SMs wrote them in
// this launch, so neither the non-coherent path nor a possibly stale L1 line may be used), and climbs
// on. The thread that finishes an object's top (the level with one digest; for a one-leaf object the
// leaf itself) hashes the 69-byte root record, built in registers, and writes out[32 o].
// No thread ever waits for another: a parent is computed by whichever child finishes last, so any
// grid size and any residency are fine.
//
// Counters (u32, one per inner node, index = node slot - n_leaves) must be zero at launch. With
// `reset_counters` the last arriver zeroes its counter again (no other thread touches it after that in
// this launch), so a buffer left zero by one launch is zero for the next launch on the same stream;
// otherwise the caller clears them before every launch.
//
// table (int64): leaf_start[n_obj + 1] (prefix sums of leaf counts), data_off[n_obj], length[n_obj],
// lv_at[n_obj] (index into table of the object's first (base slot, count) pair: levels 1, 2, ... up to
// the top, whose count is 1; unused for one-leaf objects).
//
// Every message of one thread goes through one loop with one inlined compression (code size: one
// copy of the 64 unrolled rounds); a block's 16 words come from the 16-byte-aligned path (the next
// block's four 16-byte loads in flight during this block's compression), the unaligned word path, the
// padding path (0..63 trailing bytes, 0x80, length), or the root record.

#define KMESH_LEAF 0
#define KMESH_NODE 1
#define KMESH_ROOT 2

__device__ __forceinline__ uint4 load16(const u8* p, bool coherent) {
    return coherent ? __ldcg((const uint4*)p) : __ldg((const uint4*)p);
}

__device__ __forceinline__ u32 load8(const u8* p, bool coherent) {
    return coherent ? (u32)__ldcg(p) : (u32)__ldg(p);
}

// Block t (0 or 1) after the full blocks of a message: `rem` (0..63) trailing bytes at `tail`, the 0x80
// marker right after them, zeros, and the 64-bit big-endian bit length in the last block's last 8 bytes.
__device__ __forceinline__ void padding_block(u32 w[16], const u8* tail, int rem, int t, u64 bits,
                                              bool last, bool coherent) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        u32 x = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            const int i = 4 * k + b;
            u32 byte = 0;
            if (t == 0) byte = (i < rem) ? load8(tail + i, coherent) : (i == rem ? 0x80u : 0u);
            x |= byte << (24 - 8 * b);
        }
        w[k] = x;
    }
    if (last) {
        w[14] = (u32)(bits >> 32);
        w[15] = (u32)bits;
    }
}

// Byte i (0..127) of the padded root message: "kmesh-tree-sha256/v1" 0x00 u64le(L) u32le(leaf_size)
// u32le(fanout) top[32], then 0x80, zeros and the bit length 69 * 8 = 552. With i a compile-time
// constant (unrolled loops) every branch folds away.
__device__ __forceinline__ u32 root_byte(int i, const u32 top[8], u64 length, u32 leaf_size, u32 fanout) {
    const u32 domain[5] = {0x6b6d6573u, 0x682d7472u, 0x65652d73u, 0x68613235u, 0x362f7631u};
    if (i < 20) return (domain[i >> 2] >> (24 - 8 * (i & 3))) & 0xffu;
    if (i == 20) return 0u;
    if (i < 29) return (u32)(length >> (8 * (i - 21))) & 0xffu;
    if (i < 33) return (leaf_size >> (8 * (i - 29))) & 0xffu;
    if (i < 37) return (fanout >> (8 * (i - 33))) & 0xffu;
    if (i < 69) {
        const int q = i - 37;
        return (top[q >> 2] >> (24 - 8 * (q & 3))) & 0xffu;
    }
    if (i == 69) return 0x80u;
    if (i < 126) return 0u;
    return i == 126 ? (552u >> 8) : (552u & 0xffu);
}

template <int T>
__device__ __forceinline__ void root_block(u32 w[16], const u32 top[8], u64 length, u32 leaf_size, u32 fanout) {
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        u32 x = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) x |= root_byte(64 * T + 4 * k + b, top, length, leaf_size, fanout) << (24 - 8 * b);
        w[k] = x;
    }
}

extern "C" __global__ void __launch_bounds__(SHA256_THREADS)
kmesh_sha256_tree_fused(const u8* __restrict__ data,     // payload bytes
                        const i64* __restrict__ table,   // described above
                        i64 n_obj, i64 n_leaves, i64 leaf_size, i64 fanout,
                        u8* scratch,                     // [32 x slots] leaf and node digests
                        u32* counters,                   // [inner nodes], zero at launch
                        u8* __restrict__ out,            // [n_obj, 32] roots
                        int reset_counters)
{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_leaves) return;
    const i64* leaf_start = table;
    const i64* data_off = table + n_obj + 1;
    const i64* length = data_off + n_obj;
    const i64* lv_at = length + n_obj;
    const i64 o = last_at_or_below(leaf_start, n_obj, i);
    const i64 base0 = __ldg(leaf_start + o);
    const i64 total = __ldg(length + o);

    // Current message and where it sits in the tree: node `idx` of a level of `count` nodes whose
    // digests live in slots base, base + 1, ...; `lv` points at the next level's (base, count).
    i64 idx = i - base0, base = base0, count = __ldg(leaf_start + o + 1) - base0;
    const i64* lv = table + __ldg(lv_at + o);
    const i64 begin = idx * leaf_size;
    const i64 left = total - begin;
    const u8* msg = data + __ldg(data_off + o) + begin;
    i64 len = left < leaf_size ? left : leaf_size;
    int kind = KMESH_LEAF;
    bool coherent = false;
    bool vec = ((u64)msg & 15u) == 0;
    i64 nfull = len >> 6;
    i64 nblk = (len + 72) >> 6;                          // with the padding: 1 or 2 more blocks
    u32 st[8], top[8];
    sha256_init(st);
#pragma unroll
    for (int k = 0; k < 8; ++k) top[k] = 0;
    uint4 v0 = make_uint4(0, 0, 0, 0), v1 = v0, v2 = v0, v3 = v0;
    if (vec && nfull > 0) {
        v0 = load16(msg, false); v1 = load16(msg + 16, false); v2 = load16(msg + 32, false); v3 = load16(msg + 48, false);
    }
#pragma unroll 1
    for (i64 b = 0;;) {
        u32 w[16];
        if (b < nfull) {
            if (vec) {
                words_from_vec(w, v0, v1, v2, v3);
                if (b + 1 < nfull) {
                    const u8* q = msg + ((b + 1) << 6);
                    v0 = load16(q, coherent); v1 = load16(q + 16, coherent);
                    v2 = load16(q + 32, coherent); v3 = load16(q + 48, coherent);
                }
            } else {
                // Leaves only (nodes are 16-byte aligned): aligned words realigned with one PRMT each,
                // as in sha256_full_blocks.
                const u64 addr = (u64)(msg + (b << 6));
                const u32 s = (u32)(addr & 3u);
                const u32 sel = (s + 3u) | ((s + 2u) << 4) | ((s + 1u) << 8) | (s << 12);
                const u32* p = (const u32*)(addr & ~(u64)3);
                u32 x = __ldg(p);
#pragma unroll
                for (int k = 0; k < 16; ++k) {
                    const u32 y = (k < 15 || s != 0u) ? __ldg(p + k + 1) : 0u;
                    w[k] = __byte_perm(x, y, sel);
                    x = y;
                }
            }
        } else if (kind != KMESH_ROOT) {
            padding_block(w, msg + (nfull << 6), (int)(len & 63), (int)(b - nfull), (u64)len << 3,
                          b + 1 == nblk, coherent);
        } else if (b == 0) {
            root_block<0>(w, top, (u64)total, (u32)leaf_size, (u32)fanout);
        } else {
            root_block<1>(w, top, (u64)total, (u32)leaf_size, (u32)fanout);
        }
        sha256_compress(st, w);
        if (++b < nblk) continue;

        // The message is done.
        if (kind == KMESH_ROOT) {
            store_digest(out + 32 * o, st);
            return;
        }
        if (count == 1) {                                // the top: hash the root record next
#pragma unroll
            for (int k = 0; k < 8; ++k) top[k] = st[k];
            sha256_init(st);
            kind = KMESH_ROOT;
            nfull = 0; nblk = 2; b = 0;
            continue;
        }
        uint4* slot = (uint4*)(scratch + 32 * (base + idx));
        slot[0] = make_uint4(bswap32(st[0]), bswap32(st[1]), bswap32(st[2]), bswap32(st[3]));
        slot[1] = make_uint4(bswap32(st[4]), bswap32(st[5]), bswap32(st[6]), bswap32(st[7]));
        const i64 parent = idx / fanout;
        const i64 first = parent * fanout;
        const i64 c = count - first < fanout ? count - first : fanout;
        const i64 next_base = __ldg(lv), next_count = __ldg(lv + 1);
        lv += 2;
        u32* ctr = counters + (next_base - n_leaves + parent);
        __threadfence();                                 // this digest before the count (release)
        const u32 seen = atomicAdd(ctr, 1u);
        if (seen != (u32)(c - 1)) return;                // a sibling is still running: it climbs
        if (reset_counters) *(volatile u32*)ctr = 0u;
        __threadfence();                                 // the siblings' digests after the count
        msg = scratch + 32 * (base + first);
        len = 32 * c;
        kind = KMESH_NODE;
        coherent = true;
        vec = true;
        idx = parent; base = next_base; count = next_count;
        sha256_init(st);
        nfull = len >> 6; nblk = (len + 72) >> 6; b = 0;
        if (nfull > 0) {
            v0 = load16(msg, true); v1 = load16(msg + 16, true); v2 = load16(msg + 32, true); v3 = load16(msg + 48, true);
        }
    }
}
