// Batched SHA-256 (FIPS 180-4) and the levels of the kmesh-tree-sha256/v1 digest (docs/tree-sha256.md).
//
// Framework-free: raw byte pointers and int64 offsets. One thread hashes one whole message; a launch
// hashes many independent messages. SHA-256 of one message is a serial chain of 64-byte blocks, so the
// parallelism comes from the number of messages: the tree format bounds every chain to
// leaf_size/64 + 1 blocks and makes every tree level one launch.
//
// Kernels (all extern "C", launched with 1-D grids of SHA256_THREADS threads):
//   kmesh_sha256_batched      message i = data[offsets[i] : offsets[i] + lengths[i]], digest -> out[32 i]
//   kmesh_sha256_tree_level   messages described per object (one tree level of many objects)
//   kmesh_sha256_object_naive the seed's design (one thread per whole object, textbook schedule),
//                             kept only as the baseline perf/run_sha256.py measures against

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
    i64 lo = 0, hi = n_obj - 1;                          // last object with starts[o] <= i
    while (lo < hi) {
        const i64 mid = (lo + hi + 1) >> 1;
        if (__ldg(starts + mid) <= i) lo = mid; else hi = mid - 1;
    }
    const i64 j = i - __ldg(starts + lo);
    const i64 begin = j * piece;
    const i64 left = __ldg(src_bytes + lo) - begin;
    const i64 len = left < piece ? left : piece;
    sha256_message(src + __ldg(src_off + lo) + begin, len, out + __ldg(out_off + lo) + 32 * j);
}

// Baseline only: the seed's GPU SHA-256 design, one thread per whole object, byte loads and a
// 64-word schedule array (as a first port of a textbook implementation looks). Not used by KMesh.
extern "C" __global__ void
kmesh_sha256_object_naive(const u8* data, const i64* offsets, const i64* lengths, u8* out, i64 n)
{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u8* msg = data + offsets[i];
    const i64 len = lengths[i];
    const i64 total = ((len + 8) / 64 + 1) * 64;         // padded length
    u32 st[8];
    sha256_init(st);
    u32 w[64];
    for (i64 base = 0; base < total; base += 64) {
        for (int k = 0; k < 16; ++k) {
            u32 x = 0;
            for (int b = 0; b < 4; ++b) {
                const i64 pos = base + 4 * k + b;
                u32 byte;
                if (pos < len) byte = msg[pos];
                else if (pos == len) byte = 0x80u;
                else if (pos >= total - 8) byte = (u32)(((u64)len << 3) >> (8 * (total - 1 - pos)));
                else byte = 0;
                x = (x << 8) | (byte & 0xffu);
            }
            w[k] = x;
        }
        for (int k = 16; k < 64; ++k) {
            const u32 s0 = rotr(w[k - 15], 7) ^ rotr(w[k - 15], 18) ^ (w[k - 15] >> 3);
            const u32 s1 = rotr(w[k - 2], 17) ^ rotr(w[k - 2], 19) ^ (w[k - 2] >> 10);
            w[k] = w[k - 16] + s0 + w[k - 7] + s1;
        }
        u32 a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
        for (int r = 0; r < 64; ++r) {
            const u32 t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kSha256K[r] + w[r];
            const u32 t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        st[0] += a; st[1] += b; st[2] += c; st[3] += d; st[4] += e; st[5] += f; st[6] += g; st[7] += h;
    }
    for (int k = 0; k < 8; ++k) {
        out[32 * i + 4 * k + 0] = (u8)(st[k] >> 24);
        out[32 * i + 4 * k + 1] = (u8)(st[k] >> 16);
        out[32 * i + 4 * k + 2] = (u8)(st[k] >> 8);
        out[32 * i + 4 * k + 3] = (u8)st[k];
    }
}
