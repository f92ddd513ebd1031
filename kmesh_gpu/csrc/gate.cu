// The placement's gate: a restore verifies on the device and queues its placement behind the
// verdict, with no host round trip in between.
//
// kmesh_gate_runs compares n_bytes computed digest bytes with the stored ones and, unless every
// byte matches, sets the length of each of the R runs of a run-kernel table (kmesh_place_runs in
// place.cu) to 0: the run kernel queued after it then writes nothing. One block; launched on the
// stream the placement runs on, after that stream waited for every digest.

typedef long long i64;

extern "C" __global__ void kmesh_gate_runs(const unsigned char* __restrict__ got, const unsigned char* __restrict__ want,
                                           i64 n_bytes, i64* __restrict__ runs, i64 R, i64 cols, i64 len_col)
{
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (i64 i = threadIdx.x; i < n_bytes; i += blockDim.x)
        if (got[i] != want[i]) bad = 1;  // every writer stores the same value
    __syncthreads();
    if (bad)
        for (i64 r = threadIdx.x; r < R; r += blockDim.x) runs[r * cols + len_col] = 0;
}
