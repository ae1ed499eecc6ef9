// How many bytes can one multiprocessor move per second, and through which
// port is it capped? The HT kernels at few SMs (EpGroup.num_sms = 4..8) are
// limited by this, not by HBM: a 24-SM copy of the HT rows reaches about 45 GB/s
// of rows per SM whatever its design (tools/copy_bandwidth.cu). This times, on
// 1 to 24 blocks (one per SM), the same 4096 rows of 14336 bytes (58.7 MB):
//   copy       warp per row, 16 loads of 16 bytes per lane in flight, then stores
//              (the HT kernels' register path), rows w, w + W, ... for warp w;
//   ranges     the same, block b's rows one contiguous range (the HT dispatch's
//              split at one rank);
//   tokens     ranges, plus the dispatch's per-token metadata (8 words loaded
//              with the row, 18 stored after it);
//   read       the same loads, folded into one word per thread (no row stores);
//   write      the same stores of a register pattern (no row loads);
//   tma_copy   5 bulk-copy engines per block (lane 0 of a warp), each a ring of
//              3 row-sized shared stages: cp.async.bulk global -> shared, then
//              shared -> global;
//   tma_read   the bulk loads alone;
//   tma_write  the bulk stores alone, from one stage per engine.
// GB/s per SM counts bytes read plus bytes written, over the blocks; "rows"
// GB/s per SM counts the row bytes moved (written by copy, read by read, ...).
// Copies are checked against the source. Not part of the library; results in
// docs/benchmarks.md.
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. -o sm_bandwidth tools/sm_bandwidth.cu
//   ./sm_bandwidth [out.json]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/device_common.cuh"
#include "tools/bulk_copy.cuh"
#include "tools/probe_timing.cuh"

constexpr int kRows = 4096;
constexpr int kRowBytes = 14336;
constexpr int kVecPerRow = kRowBytes / 16;
constexpr int kUnroll = 16;
constexpr int kThreads = 512;
constexpr int kEngines = 5;
constexpr int kStages = 3;

using jax_ep::cuda::ld_v4_no_alloc;
using jax_ep::cuda::st_na_v4;

enum class Mode { kCopy, kRead, kWrite, kRangeCopy, kTokenCopy };

template <Mode M>
__global__ void __launch_bounds__(kThreads, 1) sm_rows(const int4* src, int4* dst, int* sink) {
  constexpr bool kRanges = M == Mode::kRangeCopy || M == Mode::kTokenCopy;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  const int num_warps = gridDim.x * (kThreads / 32);
  // kRanges: block b copies rows [b*L, b*L + L), its warps kThreads/32 apart
  // (the HT dispatch's one-rank token split).
  const int range = (kRows + gridDim.x - 1) / gridDim.x;
  const int first = kRanges ? blockIdx.x * range + threadIdx.x / 32 : warp;
  const int end = kRanges ? min(kRows, (blockIdx.x + 1) * range) : kRows;
  const int step = kRanges ? kThreads / 32 : num_warps;
  int folded = 0;
  for (int row = first; row < end; row += step) {
    // kTokenCopy: also the dispatch's per-token metadata: 8 top-k entries and
    // weights loaded with the row and stored after it, plus two words.
    int meta = 0;
    if constexpr (M == Mode::kTokenCopy) {
      if (lane < 8) meta = __ldg(reinterpret_cast<const int*>(src) + row * 8 + lane);
    }
    const int4* s = src + static_cast<size_t>(row) * kVecPerRow;
    int4* d = dst + static_cast<size_t>(row) * kVecPerRow;
    for (int base = 0; base < kVecPerRow; base += kUnroll * 32) {
      int4 b[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if constexpr (M == Mode::kWrite) {
          b[u] = make_int4(row, v, row ^ v, 7);
        } else if (v < kVecPerRow) {
          b[u] = ld_v4_no_alloc(s + v, false);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = base + u * 32 + lane;
        if (v >= kVecPerRow) continue;
        if constexpr (M == Mode::kRead) {
          folded ^= b[u].x ^ b[u].y ^ b[u].z ^ b[u].w;
        } else {
          st_na_v4(d + v, b[u]);
        }
      }
    }
    if constexpr (M == Mode::kTokenCopy) {
      if (lane < 8) {
        sink[132 * kThreads + row * 16 + lane] = meta;
        sink[132 * kThreads + row * 16 + 8 + lane] = meta + 1;
      }
      if (lane < 2) sink[132 * kThreads + kRows * 16 + row * 2 + lane] = row;
    }
  }
  if constexpr (M == Mode::kRead) sink[blockIdx.x * kThreads + threadIdx.x] = folded;
}

template <Mode M>
__global__ void __launch_bounds__(kEngines * 32, 1) tma_rows(const int4* src, int4* dst, int*) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[kEngines][kStages];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  uint8_t* stages = smem + static_cast<size_t>(warp) * kStages * kRowBytes;
  init_stage_barriers(bars[warp], kStages);
  const EngineRows rows = engine_rows(kEngines, warp, kRows);
  const int n = rows.count;
  auto row_of = [&](int i) { return rows.row(i); };
  auto issue_load = [&](int i) {
    const int s = i % kStages;
    bulk_load_row(stages + static_cast<size_t>(s) * kRowBytes,
                  src + static_cast<size_t>(row_of(i)) * kVecPerRow, kRowBytes, &bars[warp][s]);
  };
  auto issue_store = [&](int i, int s) {
    bulk_store_row(dst + static_cast<size_t>(row_of(i)) * kVecPerRow,
                   stages + static_cast<size_t>(s) * kRowBytes, kRowBytes);
  };
  if constexpr (M == Mode::kWrite) {
    // Stores only, kStages in flight per engine, all from stage 0 (its bytes
    // are whatever shared memory holds: the row check is skipped).
    for (int i = 0; i < n; ++i) {
      issue_store(i, 0);
      asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kStages - 1) : "memory");
    }
  } else {
    for (int i = 0; i < kStages && i < n; ++i) issue_load(i);
    for (int i = 0; i < n; ++i) {
      const int s = i % kStages;
      wait_stage(&bars[warp][s], (i / kStages) & 1);
      if constexpr (M == Mode::kRead) {
        if (i + kStages < n) issue_load(i + kStages);
      } else {
        issue_store(i, s);
        if (i >= 1 && i - 1 + kStages < n) {
          // Refill the stage of row i - 1: its store was committed before this one.
          asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
          issue_load(i - 1 + kStages);
        }
      }
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

using Kernel = void (*)(const int4*, int4*, int*);

struct Result {
  const char* name;
  int grid;
  float us;
  float min_us;
  double rw_gbps_per_sm;
  double rows_gbps_per_sm;
  bool ok;
};

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : nullptr;
  setvbuf(stdout, nullptr, _IONBF, 0);
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  std::vector<int4> h_src(static_cast<size_t>(kRows) * kVecPerRow);
  std::mt19937 rng(0);
  for (auto& v : h_src) v = make_int4(rng(), rng(), rng(), rng());
  int4 *src, *dst;
  int* sink;
  if (cudaMalloc(&src, bytes) || cudaMalloc(&dst, bytes) ||
      cudaMalloc(&sink, (132 * kThreads + kRows * 18) * sizeof(int))) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(src, h_src.data(), bytes, cudaMemcpyHostToDevice);
  const size_t tma_smem = static_cast<size_t>(kEngines) * kStages * kRowBytes;
  std::vector<Result> results;
  std::vector<int4> out(static_cast<size_t>(kRows) * kVecPerRow);
  auto run = [&](const char* name, Kernel kernel, int threads, size_t smem, int grid,
                 double read_share, double write_share, bool check) {
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
    }
    cudaMemsetAsync(dst, 0xff, bytes, stream);
    const std::vector<float> per = time_launches(
        [&] { kernel<<<grid, threads, smem, stream>>>(src, dst, sink); }, stream, 3, 7, 20);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    bool ok = err == cudaSuccess;
    if (ok && check) {
      cudaMemcpy(out.data(), dst, bytes, cudaMemcpyDeviceToHost);
      ok = std::memcmp(out.data(), h_src.data(), bytes) == 0;
    }
    const double us = per[3];
    const double rw = (read_share + write_share) * bytes / (us * 1e-6) / 1e9 / grid;
    const double rows = bytes / (us * 1e-6) / 1e9 / grid;
    printf("%-10s grid %3d: %8.1f us (min %8.1f)  %6.1f GB/s r+w per SM  %6.1f GB/s rows per SM  %s%s\n",
           name, grid, us, per[0], rw, rows, ok ? "ok" : "WRONG ",
           err ? cudaGetErrorString(err) : "");
    results.push_back({name, grid, static_cast<float>(us), per[0], rw, rows, ok});
  };
  for (int grid : {1, 2, 4, 6, 8, 12, 16, 24, 32}) {
    run("copy", sm_rows<Mode::kCopy>, kThreads, 0, grid, 1, 1, true);
    run("ranges", sm_rows<Mode::kRangeCopy>, kThreads, 0, grid, 1, 1, true);
    run("tokens", sm_rows<Mode::kTokenCopy>, kThreads, 0, grid, 1, 1, true);
    run("read", sm_rows<Mode::kRead>, kThreads, 0, grid, 1, 0, false);
    run("write", sm_rows<Mode::kWrite>, kThreads, 0, grid, 0, 1, false);
    run("tma_copy", tma_rows<Mode::kCopy>, kEngines * 32, tma_smem, grid, 1, 1, true);
    run("tma_read", tma_rows<Mode::kRead>, kEngines * 32, tma_smem, grid, 1, 0, false);
    run("tma_write", tma_rows<Mode::kWrite>, kEngines * 32, tma_smem, grid, 0, 1, false);
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f != nullptr) {
      std::fprintf(f,
                   "{\n \"mode\": \"sm-bandwidth\",\n \"device\": \"%s\",\n"
                   " \"sm_count\": %d,\n \"clock_khz\": %d,\n \"rows\": %d,\n"
                   " \"row_bytes\": %d,\n \"timing\": \"3 warm-ups, then 7 repeats of"
                   " 20 launches on one stream; median and min per launch, us\",\n \"results\": [\n",
                   prop.name, prop.multiProcessorCount, clock_khz, kRows, kRowBytes);
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::fprintf(f,
                     "  {\"design\": \"%s\", \"grid\": %d, \"us\": %.2f, \"min_us\": %.2f, "
                     "\"rw_gbps_per_sm\": %.1f, \"rows_gbps_per_sm\": %.1f, \"correct\": %s}%s\n",
                     r.name, r.grid, r.us, r.min_us, r.rw_gbps_per_sm, r.rows_gbps_per_sm,
                     r.ok ? "true" : "false", i + 1 < results.size() ? "," : "");
      }
      std::fprintf(f, " ]\n}\n");
      std::fclose(f);
    }
  }
  for (const Result& r : results) {
    if (!r.ok) return 1;
  }
  return 0;
}
