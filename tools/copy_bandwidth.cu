// How fast can a few multiprocessors copy the HT rows at one rank? The HT
// dispatch at EP1 copies 4096 rows of 14336 bytes (hidden 7168, bf16) from x to
// its output; the combine copies them back in another order. Both run on 24 SMs
// (EpGroup.num_sms). This times copy designs of the same 58.7 MB on a given
// number of blocks (one per SM), each launched 20 times on one stream after 5
// warm-ups, 7 times over; the median per launch, in us and in TB/s counting
// bytes read plus bytes written. Every result is checked against the source.
// Designs:
//   rows<U,T>:   one warp per row (rows w, w + W, ...), U 16-byte vectors per
//                lane loaded, then stored (the HT kernels' register path);
//                `perm`: the source row is a random permutation of the output
//                row (the combine's gather).
//   stream<U,T>: the same rows, but the warp's next batch (of this row or the
//                next) loads before the current one is stored (two register
//                batches in flight across row ends).
//   flat<U,T>:   the buffer as one array of vectors, grid-stride, U per thread.
//   ring<E,S>:   E engines per block (lane 0 of a warp each), each a ring of S
//                row-sized shared-memory stages: bulk copies (cp.async.bulk)
//                load rows into stages (mbarrier completion) and bulk-store
//                them out, S - 1 loads ahead.
// Not part of the library; results in docs/benchmarks.md.
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. -o copy_bandwidth tools/copy_bandwidth.cu
//   ./copy_bandwidth
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device_common.cuh"
#include "tools/bulk_copy.cuh"

constexpr int kRows = 4096;
constexpr int kRowBytes = 14336;
constexpr int kVecPerRow = kRowBytes / 16;

// The kernels' own 16-byte loads and stores (cuda/device_common.cuh).
using jax_ep::cuda::ld_v4_no_alloc;
using jax_ep::cuda::st_na_v4;

template <int U, int T>
__global__ void __launch_bounds__(T, 1) rows_copy(const int4* src, int4* dst, const int* perm) {
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (T / 32) + threadIdx.x / 32;
  const int num_warps = gridDim.x * (T / 32);
  for (int row = warp; row < kRows; row += num_warps) {
    const int4* s = src + static_cast<size_t>(perm ? perm[row] : row) * kVecPerRow;
    int4* d = dst + static_cast<size_t>(row) * kVecPerRow;
    for (int base = 0; base < kVecPerRow; base += U * 32) {
      int4 b[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * 32 + lane;
        if (v < kVecPerRow) b[u] = ld_v4_no_alloc(s + v, false);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int v = base + u * 32 + lane;
        if (v < kVecPerRow) st_na_v4(d + v, b[u]);
      }
    }
  }
}

// A warp's work as a sequence of batches (row, base); batch i + 1 loads before
// batch i stores.
template <int U, int T>
__global__ void __launch_bounds__(T, 1) stream_copy(const int4* src, int4* dst, const int* perm) {
  constexpr int kBatchVec = U * 32;
  constexpr int kBatchesPerRow = (kVecPerRow + kBatchVec - 1) / kBatchVec;
  const int lane = threadIdx.x % 32;
  const int warp = blockIdx.x * (T / 32) + threadIdx.x / 32;
  const int num_warps = gridDim.x * (T / 32);
  const int my_rows = warp < kRows ? (kRows - 1 - warp) / num_warps + 1 : 0;
  const int num_batches = my_rows * kBatchesPerRow;
  auto src_of = [&](int i) {
    const int row = warp + (i / kBatchesPerRow) * num_warps;
    return src + static_cast<size_t>(perm ? perm[row] : row) * kVecPerRow +
           (i % kBatchesPerRow) * kBatchVec;
  };
  auto dst_of = [&](int i) {
    const int row = warp + (i / kBatchesPerRow) * num_warps;
    return dst + static_cast<size_t>(row) * kVecPerRow + (i % kBatchesPerRow) * kBatchVec;
  };
  auto limit_of = [&](int i) { return kVecPerRow - (i % kBatchesPerRow) * kBatchVec; };
  int4 a[U], b[U];
  auto load = [&](int4(&r)[U], int i) {
    const int4* s = src_of(i);
    const int n = limit_of(i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u * 32 + lane < n) r[u] = ld_v4_no_alloc(s + u * 32 + lane, false);
    }
  };
  auto store = [&](const int4(&r)[U], int i) {
    int4* d = dst_of(i);
    const int n = limit_of(i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u * 32 + lane < n) st_na_v4(d + u * 32 + lane, r[u]);
    }
  };
  if (num_batches > 0) load(a, 0);
  for (int i = 0; i < num_batches; i += 2) {
    if (i + 1 < num_batches) load(b, i + 1);
    store(a, i);
    if (i + 1 >= num_batches) break;
    if (i + 2 < num_batches) load(a, i + 2);
    store(b, i + 1);
  }
}

template <int U, int T>
__global__ void __launch_bounds__(T, 1) flat_copy(const int4* src, int4* dst, const int*) {
  const size_t total = static_cast<size_t>(kRows) * kVecPerRow;
  const size_t stride = static_cast<size_t>(gridDim.x) * T;
  for (size_t i0 = blockIdx.x * T + threadIdx.x; i0 < total; i0 += U * stride) {
    int4 b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * stride < total) b[u] = ld_v4_no_alloc(src + i0 + u * stride, false);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (i0 + u * stride < total) st_na_v4(dst + i0 + u * stride, b[u]);
    }
  }
}

template <int E, int S>
__global__ void __launch_bounds__(E * 32, 1) ring_copy(const int4* src, int4* dst, const int* perm) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[E][S];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  uint8_t* stages = smem + static_cast<size_t>(warp) * S * kRowBytes;
  init_stage_barriers(bars[warp], S);
  const EngineRows rows = engine_rows(E, warp, kRows);
  const int n = rows.count;
  auto row_of = [&](int i) { return rows.row(i); };
  auto issue_load = [&](int i) {
    const int s = i % S;
    const int row = row_of(i);
    bulk_load_row(stages + static_cast<size_t>(s) * kRowBytes,
                  src + static_cast<size_t>(perm ? perm[row] : row) * kVecPerRow, kRowBytes,
                  &bars[warp][s]);
  };
  for (int i = 0; i < S && i < n; ++i) issue_load(i);
  for (int i = 0; i < n; ++i) {
    const int s = i % S;
    wait_stage(&bars[warp][s], (i / S) & 1);
    bulk_store_row(dst + static_cast<size_t>(row_of(i)) * kVecPerRow,
                   stages + static_cast<size_t>(s) * kRowBytes, kRowBytes);
    if constexpr (S == 1) {  // the only stage: refill it once this store has read it
      if (i + 1 < n) {
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        issue_load(i + 1);
      }
    } else if (i >= 1 && i - 1 + S < n) {
      // Refill the stage of row i - 1: its store was committed before this one.
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      issue_load(i - 1 + S);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

using Kernel = void (*)(const int4*, int4*, const int*);

struct Result {
  const char* name;
  int grid;
  bool perm;
  float us;
  float min_us;
  bool ok;
};

Result time_copy(const char* name, Kernel kernel, int threads, size_t smem, int grid,
                 const int4* src, int4* dst, const int* perm, const std::vector<int>& h_perm,
                 const std::vector<int4>& h_src, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(smem));
  }
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  cudaMemsetAsync(dst, 0xff, bytes, stream);
  for (int i = 0; i < 5; ++i) kernel<<<grid, threads, smem, stream>>>(src, dst, perm);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> per;
  constexpr int kLaunches = 20;
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0, stream);
    for (int i = 0; i < kLaunches; ++i) kernel<<<grid, threads, smem, stream>>>(src, dst, perm);
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    per.push_back(ms * 1000.0f / kLaunches);
  }
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  std::vector<int4> out(static_cast<size_t>(kRows) * kVecPerRow);
  cudaMemcpy(out.data(), dst, bytes, cudaMemcpyDeviceToHost);
  bool ok = err == cudaSuccess;
  for (int row = 0; ok && row < kRows; ++row) {
    const int from = perm ? h_perm[row] : row;
    ok = std::memcmp(&out[static_cast<size_t>(row) * kVecPerRow],
                     &h_src[static_cast<size_t>(from) * kVecPerRow], kRowBytes) == 0;
  }
  std::sort(per.begin(), per.end());
  const double tbps = 2.0 * bytes / (per[3] * 1e-6) / 1e12;
  printf("%-26s %-5s grid %3d: %7.1f us (min %7.1f)  %5.2f TB/s  %s%s\n", name,
         perm ? "perm" : "", grid, per[3], per[0], tbps, ok ? "ok" : "WRONG ",
         err ? cudaGetErrorString(err) : "");
  return {name, grid, perm != nullptr, per[3], per[0], ok};
}

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : nullptr;
  setvbuf(stdout, nullptr, _IONBF, 0);
  cudaSetDevice(0);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  const size_t bytes = static_cast<size_t>(kRows) * kRowBytes;
  std::vector<int4> h_src(static_cast<size_t>(kRows) * kVecPerRow);
  std::mt19937 rng(0);
  for (auto& v : h_src) v = make_int4(rng(), rng(), rng(), rng());
  std::vector<int> h_perm(kRows);
  std::iota(h_perm.begin(), h_perm.end(), 0);
  std::shuffle(h_perm.begin(), h_perm.end(), rng);
  int4 *src, *dst;
  int* perm;
  cudaMalloc(&src, bytes);
  cudaMalloc(&dst, bytes);
  cudaMalloc(&perm, kRows * sizeof(int));
  cudaMemcpy(src, h_src.data(), bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(perm, h_perm.data(), kRows * sizeof(int), cudaMemcpyHostToDevice);
  std::vector<Result> results;
  auto run = [&](const char* name, Kernel k, int threads, size_t smem, int grid, bool use_perm) {
    results.push_back(time_copy(name, k, threads, smem, grid, src, dst, use_perm ? perm : nullptr,
                                h_perm, h_src, stream));
  };
  for (int grid : {24, 32, 48, 132}) run("rows<16,512>", rows_copy<16, 512>, 512, 0, grid, false);
  run("rows<16,512>", rows_copy<16, 512>, 512, 0, 24, true);
  run("rows<28,256>", rows_copy<28, 256>, 256, 0, 24, false);
  run("rows<28,384>", rows_copy<28, 384>, 384, 0, 24, false);
  run("rows<8,1024>", rows_copy<8, 1024>, 1024, 0, 24, false);
  run("rows<14,768>", rows_copy<14, 768>, 768, 0, 24, false);
  run("stream<8,512>", stream_copy<8, 512>, 512, 0, 24, false);
  run("stream<12,512>", stream_copy<12, 512>, 512, 0, 24, false);
  run("stream<12,512>", stream_copy<12, 512>, 512, 0, 24, true);
  run("stream<6,1024>", stream_copy<6, 1024>, 1024, 0, 24, false);
  run("flat<8,512>", flat_copy<8, 512>, 512, 0, 24, false);
  run("flat<16,512>", flat_copy<16, 512>, 512, 0, 24, false);
  run("flat<8,1024>", flat_copy<8, 1024>, 1024, 0, 24, false);
  run("flat<8,512>", flat_copy<8, 512>, 512, 0, 132, false);
  run("ring<1,15>", ring_copy<1, 15>, 32, 15 * kRowBytes, 24, false);
  run("ring<3,5>", ring_copy<3, 5>, 96, 15 * kRowBytes, 24, false);
  run("ring<5,3>", ring_copy<5, 3>, 160, 15 * kRowBytes, 24, false);
  run("ring<5,3>", ring_copy<5, 3>, 160, 15 * kRowBytes, 24, true);
  run("ring<15,1>", ring_copy<15, 1>, 480, 15 * kRowBytes, 24, false);
  run("ring<5,3>", ring_copy<5, 3>, 160, 15 * kRowBytes, 132, false);
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f != nullptr) {
      std::fprintf(f, "{\n \"mode\": \"copy-bandwidth\",\n \"rows\": %d,\n \"row_bytes\": %d,\n"
                      " \"timing\": \"20 launches on one stream after 5 warm-ups, 7 times over;"
                      " median and min per launch, us; TB/s counts bytes read plus written\",\n"
                      " \"results\": [\n", kRows, kRowBytes);
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::fprintf(f, "  {\"design\": \"%s\", \"perm\": %s, \"grid\": %d, \"us\": %.2f, "
                        "\"min_us\": %.2f, \"tbps\": %.3f, \"correct\": %s}%s\n",
                     r.name, r.perm ? "true" : "false", r.grid, r.us, r.min_us,
                     2.0 * bytes / (r.us * 1e-6) / 1e12, r.ok ? "true" : "false",
                     i + 1 < results.size() ? "," : "");
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
