// The LL one-rank dispatch kernel alone, without XLA: the library's
// LaunchLlDispatch (cuda/ll_dispatch.cu) with a context of plain device
// buffers (no NVSHMEM start: the one-rank kernel sends nothing), launched 50
// times as dependent nodes of one CUDA graph, the graph replayed 40 times, 9
// times over; the median per launch. DeepEP's LL shape: 128 tokens, hidden
// 7168, 256 experts, top-8; no rows (every entry -1) and random routing, BF16
// and FP8; grids of 132, 96, 64 and 32 blocks (`quick`: 132 only). Floors in
// the same loop: an empty kernel with one pointer, one with the LL kernels'
// parameters, and six barrier phases with and without dead code between them
// (the cost of jumping over code that is not run).
//
// Built with -DLL_PROBE against the copy of cuda/ll_dispatch.cu that
// tools/ll_one_rank_probe_marks.py writes, it also prints each phase of one
// launch from thread 0 of every block (clock64 at the phase boundaries). On
// the routing table's way: the start loads to the routing pass's first
// barrier, the routing pass, the fill of rows past count, the token loop, the
// end; on the per-block questions' way (DeepEP's LL shape at 132 blocks):
// thread 0's start to the barrier, the barrier, the fill, the pairs, the end.
// Not part of the library; results in docs/history.md.
//
//   NV=$(python3 -c "import nvidia.nvshmem as m; print(m.__path__[0])")
//   F="-O3 -DNDEBUG -std=c++17 -arch=sm_90 -rdc=true --expt-relaxed-constexpr -I. -I$NV/include
//      -L$NV/lib -lnvshmem_device -l:libnvshmem_host.so.3 -Xlinker -rpath=$NV/lib"
//   nvcc $F tools/ll_one_rank_probe.cu cuda/ll_dispatch.cu -o ll_one_rank_probe
//   python3 tools/ll_one_rank_probe_marks.py > /tmp/ll_dispatch_marked.cu
//   nvcc $F -DLL_PROBE tools/ll_one_rank_probe.cu /tmp/ll_dispatch_marked.cu -o ll_one_rank_probe_marked
//   ./ll_one_rank_probe [quick]
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>
#include "cuda/ep_types.h"
#include "cuda/ll_launch.h"
#include "cuda/transport.cuh"
// The transport's constant tables live in cuda/runtime.cu, which this tool
// does not link; the one-rank kernel never reads them.
namespace jax_ep::cuda::transport {
__constant__ int32_t group_pes[kMaxGroupRanks] = {};
__constant__ uint32_t rdma_only_peers[kRdmaOnlyPeerWords] = {};
}
using namespace jax_ep::cuda;
#ifdef LL_PROBE
extern __device__ long long g_probe_clk[1024 * 8];
extern __device__ unsigned long long g_probe_gt[1024 * 2];
#endif
__global__ void empty_small(int* p) {}
__global__ void __launch_bounds__(256, 1) empty_big(LlContext ctx, LlDispatchArgs args) {
  if (ctx.dims.rank == 12345) args.out_count[0] = 1;
}

// i-cache test: the same executed path, with or without large dead code between its phases.
template <bool kBig>
__global__ void __launch_bounds__(256, 1) icache_test(int* out, int magic) {
  __shared__ int s[256];
  float acc = threadIdx.x;
#define PHASE(n) \
  s[threadIdx.x] = threadIdx.x + n; __syncthreads(); \
  if (kBig && magic == 12345 + n) { \
    _Pragma("unroll") for (int i = 0; i < 600; ++i) acc = fmaf(acc, 1.0001f + i, s[(threadIdx.x + i) % 256]); \
    out[threadIdx.x] = (int)acc; } \
  __syncthreads();
  PHASE(0) PHASE(1) PHASE(2) PHASE(3) PHASE(4) PHASE(5)
  if (threadIdx.x == 0 && s[5] == magic) out[0] = 1;
}
#define CK(x) do { cudaError_t e = (x); if (e) { printf("%s: %s\n", #x, cudaGetErrorString(e)); exit(1);} } while (0)
template <typename F>
float time_graph(const char* name, cudaStream_t s, F launch) {
  constexpr int kCalls = 50, kReps = 40;
  cudaGraph_t g; cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCalls; ++i) launch();
  CK(cudaStreamEndCapture(s, &g));
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 20; ++i) cudaGraphLaunch(ge, s);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  std::vector<float> per;
  for (int r = 0; r < 9; ++r) {
    cudaEventRecord(e0, s);
    for (int i = 0; i < kReps; ++i) cudaGraphLaunch(ge, s);
    cudaEventRecord(e1, s); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); per.push_back(ms * 1000.f / (kCalls * kReps));
  }
  std::sort(per.begin(), per.end());
  CK(cudaGetLastError());
  printf("%-40s %6.3f us per launch (min %.3f max %.3f)\n", name, per[4], per[0], per[8]);
  cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
  return per[4];
}
int main(int argc, char** argv) {
  CK(cudaSetDevice(0));
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int T = 128, H = 7168, E = 256, K = 8;
  LlContext ctx{};
  ctx.dims = EpDims{1, 0, E, E, H, 4096, T, K};
  CK(cudaMalloc(&ctx.counters, sizeof(DeviceCounters))); CK(cudaMemset(ctx.counters, 0, sizeof(DeviceCounters)));
  DeviceStatus* st; CK(cudaHostAlloc(&st, sizeof(DeviceStatus), cudaHostAllocMapped)); memset(st, 0, sizeof(*st));
  CK(cudaHostGetDevicePointer((void**)&ctx.status, st, 0));
  CK(cudaMalloc(&ctx.slot_counters, 4 * E)); CK(cudaMemset(ctx.slot_counters, 0, 4 * E));
  CK(cudaMalloc(&ctx.rank_counters, 64)); CK(cudaMemset(ctx.rank_counters, 0, 64));
  CK(cudaMalloc(&ctx.masked, 4 * kMaxMaskedRanks)); CK(cudaMemset(ctx.masked, 0, 4 * kMaxMaskedRanks));
  uint32_t* mh; CK(cudaHostAlloc(&mh, 4 * kMaxMaskedRanks, cudaHostAllocMapped)); memset(mh, 0, 4 * kMaxMaskedRanks);
  CK(cudaHostGetDevicePointer((void**)&ctx.masked_mirror, mh, 0));
  ctx.timeout_ns = 10000000000ull;
  cudaDeviceGetAttribute(&ctx.num_sms, cudaDevAttrMultiProcessorCount, 0);
  ctx.buffers.message_bytes = LlMessageBytes(H);
  CK(PrepareLlKernels());
  void* x; CK(cudaMalloc(&x, (size_t)T * H * 2)); CK(cudaMemset(x, 0x3c, (size_t)T * H * 2));
  std::vector<int> none(T * K, -1), rnd(T * K);
  std::mt19937 gen(1);
  for (int t = 0; t < T; ++t) { std::vector<int> p(E); for (int i = 0; i < E; ++i) p[i] = i; std::shuffle(p.begin(), p.end(), gen); for (int k = 0; k < K; ++k) rnd[t * K + k] = p[k]; }
  int *idx_none, *idx_rnd; CK(cudaMalloc(&idx_none, 4 * T * K)); CK(cudaMalloc(&idx_rnd, 4 * T * K));
  CK(cudaMemcpy(idx_none, none.data(), 4 * T * K, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idx_rnd, rnd.data(), 4 * T * K, cudaMemcpyHostToDevice));
  LlDispatchArgs a{};
  a.x = x; a.num_tokens = T;
  CK(cudaMalloc(&a.num_invalid, 4));
  CK(cudaMalloc(&a.out_x, (size_t)E * T * H * 2));
  CK(cudaMalloc(&a.out_scales, (size_t)E * T * (H / 128) * 4));
  CK(cudaMalloc(&a.out_count, 4 * E));
  CK(cudaMalloc(&a.out_recv_src, 4 * E * T));
  int* sink; CK(cudaMalloc(&sink, 64));
  time_graph("empty kernel, one pointer", s, [&] { empty_small<<<132, 256, 0, s>>>(sink); });
  time_graph("6 phases, compact code", s, [&] { icache_test<false><<<132, 256, 0, s>>>(sink, 0); });
  time_graph("6 phases, dead code between", s, [&] { icache_test<true><<<132, 256, 0, s>>>(sink, 0); });
  time_graph("empty kernel, LL params + 6 KB smem", s, [&] { empty_big<<<132, 256, 6144, s>>>(ctx, a); });
  auto run = [&](const char* name, const int* idx, bool fp8) {
    LlDispatchArgs b = a; b.topk_idx = idx; b.use_fp8 = fp8;
    return time_graph(name, s, [&] { CK(LaunchLlDispatch(ctx, b, LlParts::kBoth, s)); });
  };
  const int sms = ctx.num_sms;
  const bool quick = argc > 1 && strcmp(argv[1], "quick") == 0;
  std::vector<int> grids = quick ? std::vector<int>{sms} : std::vector<int>{sms, 96, 64, 32, sms};
  for (int grid : grids) {
    ctx.num_sms = grid;
    char n[96];
    snprintf(n, sizeof n, "no rows BF16, grid %d", grid); run(n, idx_none, false);
    snprintf(n, sizeof n, "random BF16, grid %d", grid); run(n, idx_rnd, false);
    snprintf(n, sizeof n, "random FP8, grid %d", grid); run(n, idx_rnd, true);
  }
  ctx.num_sms = sms;
#ifdef LL_PROBE
  // One launch alone, after a warm one: its per-block clocks, in microseconds
  // at the SM's rated clock (the clocks are left as they are).
  int clock_khz = 0;
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double cycles_per_us = clock_khz / 1e3;
  printf("SM clock rate %d kHz\n", clock_khz);
  for (int rep = 0; rep < 3; ++rep) {
    LlDispatchArgs b = a; b.topk_idx = rep == 2 ? idx_rnd : idx_none;
    CK(LaunchLlDispatch(ctx, b, LlParts::kBoth, s));
    CK(LaunchLlDispatch(ctx, b, LlParts::kBoth, s));
    CK(cudaStreamSynchronize(s));
    std::vector<long long> clk(1024 * 8); std::vector<unsigned long long> gt(2048);
    CK(cudaMemcpyFromSymbol(clk.data(), g_probe_clk, clk.size() * 8));
    CK(cudaMemcpyFromSymbol(gt.data(), g_probe_gt, gt.size() * 8));
    const int G = 132;
    unsigned long long gt0 = ~0ull, gt1 = 0;
    for (int b2 = 0; b2 < G; ++b2) { gt0 = std::min(gt0, gt[2 * b2]); gt1 = std::max(gt1, gt[2 * b2 + 1]); }
    printf("%s: first block start -> last block end %.3f us (globaltimer)\n", rep == 2 ? "random" : "no rows", (gt1 - gt0) / 1e3);
    std::vector<double> ph[6];
    std::vector<double> st;
    for (int b2 = 0; b2 < G; ++b2) {
      st.push_back((gt[2 * b2] - gt0) / 1e3);
      for (int k = 1; k < 6; ++k) {
        ph[k].push_back((clk[b2 * 8 + k] - clk[b2 * 8 + k - 1]) / cycles_per_us);
      }
    }
    auto show = [](const char* n, std::vector<double> v) { std::sort(v.begin(), v.end());
      printf("  %-28s min %.3f  med %.3f  p90 %.3f  max %.3f us\n", n, v[0], v[v.size() / 2], v[v.size() * 9 / 10], v.back()); };
    show("block start (globaltimer)", st);
    // The routing table's phases / the per-block questions' (ll_one_rank_probe_marks.py).
    const char* names[6] = {"", "start -> barrier 1 / to barrier", "routing pass / barrier",
                            "fill", "token loop / pairs", "finish"};
    for (int k = 1; k < 6; ++k) show(names[k], ph[k]);
    std::vector<double> ends; for (int b2 = 0; b2 < G; ++b2) ends.push_back((gt[2 * b2 + 1] - gt0) / 1e3);
    show("block end (globaltimer)", ends);
  }
#endif
  printf("status code %u\n", st->code);
  return 0;
}
