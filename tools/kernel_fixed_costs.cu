// The fixed cost of the LL kernels' building blocks, one at a time, on one GPU:
// each variant of a 132-block, 256-thread kernel is launched 50 times as
// dependent nodes of one CUDA graph (as XLA's command buffers run jax_ep's
// calls), the graph replayed 40 times, 7 times over; the median per kernel.
// Blocks: the routing pass's loads and shared-memory counts (kRoute), the
// handle's fill of rows past count (kFill), a grid-wide arrival counter
// (kArrive: one acq_rel atomic per block, the last block writes), one read of
// host-mapped memory (kHost), a 14 KB row loaded (kRowLoad) or stored
// (kRowStore) per block, the sequence number's load and store (kSeq).
// Not part of the library; results in docs/history.md.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o kernel_fixed_costs tools/kernel_fixed_costs.cu
//   ./kernel_fixed_costs
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

constexpr int kThreads = 256;
struct Bufs {
  const int* idx;      // [128*8]
  int* recv_src;       // [256*128]
  const int4* x;       // [128][896]
  int4* out;           // [128][896]
  unsigned* counter;   // arrival
  unsigned* seq;       // device word
  volatile unsigned* host_word;  // host-mapped
  int* sink;
};

__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
__device__ __forceinline__ int4 ld_na(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

enum : unsigned { kRoute = 1, kFill = 2, kArrive = 4, kHost = 8, kRowLoad = 16, kRowStore = 32,
                  kSeq = 64 };

template <unsigned kWhat>
__global__ void __launch_bounds__(kThreads, 1) k(Bufs b) {
  extern __shared__ int smem[];
  __shared__ int s_count[512];
  unsigned seq = 0, host = 0;
  if (kWhat & kSeq) seq = *reinterpret_cast<volatile unsigned*>(b.seq) + 1;
  if ((kWhat & kHost) && blockIdx.x == 0 && threadIdx.x == 0) host = *b.host_word;
  int4 row[4];
  if (kWhat & kRowLoad) {
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      int v = u * kThreads + threadIdx.x;
      row[u] = v < 896 ? ld_na(b.x + blockIdx.x % 128 * 896 + v) : make_int4(0, 0, 0, 0);
    }
  }
  if (kWhat & kRoute) {
    int e[8];
    if (threadIdx.x < 128) {
      const int4* p = reinterpret_cast<const int4*>(b.idx + threadIdx.x * 8);
      int4 a = __ldg(p), c = __ldg(p + 1);
      e[0] = a.x; e[1] = a.y; e[2] = a.z; e[3] = a.w; e[4] = c.x; e[5] = c.y; e[6] = c.z; e[7] = c.w;
    }
    for (int i = threadIdx.x; i < 512; i += kThreads) s_count[i] = 0;
    __syncthreads();
    if (threadIdx.x < 128) {
      for (int j = 0; j < 8; ++j) {
        smem[threadIdx.x * 8 + j] = e[j];
        if (e[j] >= 0) atomicAdd(s_count + e[j], 1);
      }
    }
    __syncthreads();
  }
  if (kWhat & kFill) {
    for (int ex = blockIdx.x; ex < 256; ex += gridDim.x) {
      int c = (kWhat & kRoute) ? s_count[ex] : 0;
      for (int r = c + threadIdx.x; r < 128; r += kThreads) b.recv_src[ex * 128 + r] = -1;
    }
  }
  if (kWhat & kRowLoad) {
    int s = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u) s ^= row[u].x ^ row[u].w;
    if (s == 0x12345678) b.sink[threadIdx.x] = s;
  }
  if (kWhat & kRowStore) {
    for (int v = threadIdx.x; v < 896; v += kThreads) b.out[blockIdx.x % 128 * 896 + v] = make_int4(0, 0, 0, 0);
  }
  if (kWhat & kArrive) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
      last = atom_add_acq_rel_gpu(b.counter, 1u) == gridDim.x - 1;
      if (last) *b.counter = 0u;
    }
    __syncthreads();
    if (last && threadIdx.x == 0) *b.seq = seq;
  } else if ((kWhat & kSeq) && blockIdx.x == 0 && threadIdx.x == 0) {
    *b.seq = seq;
  }
  if ((kWhat & kHost) && blockIdx.x == 0 && threadIdx.x == 0 && host != 0) b.sink[0] = host;
}

template <unsigned kWhat>
float time_kernel(const char* name, Bufs b, int grid, size_t dyn_smem, cudaStream_t s) {
  auto kern = k<kWhat>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  cudaGraph_t g;
  cudaGraphExec_t ge;
  constexpr int kCalls = 50, kReps = 40;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < kCalls; ++i) kern<<<grid, kThreads, dyn_smem, s>>>(b);
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&ge, g, 0);
  for (int i = 0; i < 3; ++i) cudaGraphLaunch(ge, s);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> per;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0, s);
    for (int i = 0; i < kReps; ++i) cudaGraphLaunch(ge, s);
    cudaEventRecord(e1, s);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    per.push_back(ms * 1000.0f / (kCalls * kReps));
  }
  std::sort(per.begin(), per.end());
  cudaError_t err = cudaGetLastError();
  printf("%-34s grid %3d smem %6zu: %6.2f us per kernel (min %.2f)%s%s\n", name, grid, dyn_smem,
         per[3], per[0], err ? " ERROR " : "", err ? cudaGetErrorString(err) : "");
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return per[3];
}

int main() {
  cudaSetDevice(0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  Bufs b{};
  std::vector<int> idx(1024, -1);
  int* d_idx; cudaMalloc(&d_idx, 4096); cudaMemcpy(d_idx, idx.data(), 4096, cudaMemcpyHostToDevice);
  b.idx = d_idx;
  cudaMalloc(&b.recv_src, 256 * 128 * 4);
  int4* x; cudaMalloc(&x, 128 * 896 * 16); cudaMemset(x, 0, 128 * 896 * 16); b.x = x;
  cudaMalloc(&b.out, 128 * 896 * 16);
  cudaMalloc(&b.counter, 4); cudaMemset(b.counter, 0, 4);
  cudaMalloc(&b.seq, 4); cudaMemset(b.seq, 0, 4);
  unsigned* hw; cudaHostAlloc(&hw, 64, cudaHostAllocMapped); *hw = 0;
  unsigned* hwd; cudaHostGetDevicePointer(&hwd, hw, 0); b.host_word = hwd;
  cudaMalloc(&b.sink, 4096);
  const size_t dyn = 1024 * 4 + 512 * 4 * 2;
  time_kernel<0>("empty", b, 132, 0, s);
  time_kernel<0>("empty", b, 132, dyn, s);
  time_kernel<0>("empty", b, 1, 0, s);
  time_kernel<kSeq>("seq", b, 132, dyn, s);
  time_kernel<kRoute>("route", b, 132, dyn, s);
  time_kernel<kRoute | kFill>("route+fill", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kSeq>("route+fill+seq", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kArrive | kSeq>("route+fill+arrive+seq", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kHost | kSeq>("route+fill+host+seq", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kRowLoad | kSeq>("route+fill+rowload+seq", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kRowStore | kSeq>("route+fill+rowstore+seq", b, 132, dyn, s);
  time_kernel<kHost>("host", b, 132, 0, s);
  time_kernel<kArrive>("arrive", b, 132, 0, s);
  time_kernel<kRowStore>("rowstore", b, 132, 0, s);
  time_kernel<kRoute | kFill | kArrive | kHost | kRowLoad | kSeq>("all (no-rows dispatch shape)", b, 132, dyn, s);
  time_kernel<kRoute | kFill | kArrive | kHost | kRowLoad | kSeq>("all (no-rows dispatch shape)", b, 64, dyn, s);
  time_kernel<kRoute | kFill | kArrive | kHost | kRowLoad | kSeq>("all (no-rows dispatch shape)", b, 32, dyn, s);
  time_kernel<kRowStore | kArrive | kSeq>("rowstore+arrive+seq (combine shape)", b, 132, 0, s);
  time_kernel<kRowStore | kSeq>("rowstore+seq", b, 128, 0, s);
  return 0;
}
