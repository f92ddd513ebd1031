// The seed's GPU SHA-256 design, kept only as the baseline perf/run_sha256.py measures the tree
// digest against (DESIGN.md §3): one thread per whole object, byte loads and a 64-word schedule
// array, as a first port of a textbook implementation looks. Not part of KMesh.
typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

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

__device__ __forceinline__ void sha256_init(u32 st[8]) {
    st[0] = 0x6a09e667u; st[1] = 0xbb67ae85u; st[2] = 0x3c6ef372u; st[3] = 0xa54ff53au;
    st[4] = 0x510e527fu; st[5] = 0x9b05688cu; st[6] = 0x1f83d9abu; st[7] = 0x5be0cd19u;
}

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
