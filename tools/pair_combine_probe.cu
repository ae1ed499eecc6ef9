// Why does the expert-major combine read only about 54 GB/s of pair rows per
// SM at 24 SMs, half what the same SMs read in tools/sm_bandwidth.cu? This
// times, on the HT shapes at EP1 (4096 tokens, hidden 7168 bf16, top-8 of 256
// experts, pair rows grouped by expert in token order, 470 MB), ways of
// summing each token's 8 pair rows in float32 (0.0f + y_0 + ... + y_7 in
// ascending expert, then 0.0f + that, rounded once: the kernel's arithmetic):
//   regs       the kernel's way (cuda/ht_pair_combine.cu): a warp per token,
//              kVec vectors of each of the 8 rows loaded per lane, then summed
//              and stored, round after round;
//   fold       the same loads, folded into one word (no sums, no stores);
//   contig     regs with each token's pairs in 8 adjacent rows (the access
//              pattern's share);
//   pipe       regs with the next round's loads issued before this round's
//              sums (two register sets, kVec = 1);
//   async      each lane's vectors through a ring of kStages shared-memory
//              stages by cp.async (LDGSTS): kStages - 1 rounds in flight while
//              one is summed, no registers held by loads in flight;
// and the dispatch's side, a token row to its 8 pair rows:
//   expand     a warp per token, kVec vectors per lane (14 or 4) loaded, stored 8 times;
//   write      the same stores of a register pattern (no loads);
//   ranges     expand with block b's tokens one contiguous range, its warps'
//              tokens 16 apart (the one-rank dispatch's split);
//   meta       ranges plus the dispatch's per-pair words (expert, weight and
//              staging row of each pair row; slot and pair row of each entry);
//   dynamic    expand with each warp taking its next token from a counter in
//              global memory (one atomicAdd per token, taken a token ahead),
//              so faster SMs take more tokens than slower ones.
// For the expanding designs the last launch's block start and end times
// (globaltimer) are kept: `end_spread` = last block end - first block end,
// `span` = last end - first start. A spread well above a token's time at one
// SM says the SMs of a static split do not finish together.
// Sums are checked bit for bit against the host; expand against its source.
// Not part of the library; results in docs/benchmarks.md.
//   nvcc -O3 -std=c++17 -arch=sm_90 -I. -o pair_combine_probe tools/pair_combine_probe.cu
//   ./pair_combine_probe [out.json]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "cuda/device_common.cuh"
#include "cuda/ht_row_elements.cuh"
#include "tools/probe_timing.cuh"

constexpr int kTokens = 4096;
constexpr int kTopk = 8;
constexpr int kExperts = 256;
constexpr int kHidden = 7168;
constexpr int kVecPerRow = kHidden * 2 / 16;  // 896 vectors of 8 bf16
constexpr int kPairs = kTokens * kTopk;

using jax_ep::cuda::ld_v4_no_alloc;
using jax_ep::cuda::st_na_v4;

enum class Design { kRegs, kFold, kPipe, kAsync, kExpand, kWrite, kRanges, kMeta, kDynamic };

constexpr int kMaxGrid = 132;
// Block b's start and end (ns) in the last launch: [2 * b], [2 * b + 1].
__device__ unsigned long long g_block_times[2 * kMaxGrid];
// kDynamic: the next token, and warps done (the last one resets both).
__device__ unsigned int g_next_token, g_warps_done;

// The kernels' own arithmetic (cuda/ht_row_elements.cuh): acc += the vector's
// elements; the vector of 0.0f + acc, rounded (the one-rank combine's total).
using Bf16 = jax_ep::cuda::RowElements<__nv_bfloat16>;
__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) { Bf16::add(acc, v); }
__device__ __forceinline__ int4 round_bf16x8(const float (&acc)[8]) {
  float total[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) total[j] = 0.0f + acc[j];
  return Bf16::pack(total);
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
               "l"(gmem)
               : "memory");
}

// rows: [kTokens][kTopk] pair rows of each token in ascending expert.
template <int kThreads, int kVec, Design D, int kStages>
__global__ void __launch_bounds__(kThreads, 1)
    pair_rows(const int4* y, const int* rows, const int4* x, int4* out, int* sink) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kRound = kVec * 32;  // vectors of a row per round
  constexpr int kRounds = kVecPerRow / kRound;
  static_assert(kVecPerRow % kRound == 0, "whole rounds");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int first = blockIdx.x * kWarps + warp, step = gridDim.x * kWarps;
  int folded = 0;
  if (threadIdx.x == 0 && blockIdx.x < kMaxGrid) {
    g_block_times[2 * blockIdx.x] = jax_ep::cuda::global_timer_ns();
  }
  if constexpr (D == Design::kRegs || D == Design::kFold) {
    for (int t = first; t < kTokens; t += step) {
      const int pair_row = lane < kTopk ? rows[t * kTopk + lane] : 0;
      for (int base = 0; base < kVecPerRow; base += kRound) {
        int4 raw[kTopk][kVec];
#pragma unroll
        for (int q = 0; q < kTopk; ++q) {
          const int4* src = y + static_cast<size_t>(__shfl_sync(~0u, pair_row, q)) * kVecPerRow;
#pragma unroll
          for (int u = 0; u < kVec; ++u) {
            raw[q][u] = ld_v4_no_alloc(src + base + u * 32 + lane, false);
          }
        }
        if constexpr (D == Design::kFold) {
#pragma unroll
          for (int q = 0; q < kTopk; ++q) {
#pragma unroll
            for (int u = 0; u < kVec; ++u) {
              folded ^= raw[q][u].x ^ raw[q][u].y ^ raw[q][u].z ^ raw[q][u].w;
            }
          }
        } else {
#pragma unroll
          for (int u = 0; u < kVec; ++u) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
            for (int q = 0; q < kTopk; ++q) add_bf16x8(acc, raw[q][u]);
            st_na_v4(out + static_cast<size_t>(t) * kVecPerRow + base + u * 32 + lane,
                     round_bf16x8(acc));
          }
        }
      }
    }
  } else if constexpr (D == Design::kPipe) {
    static_assert(kVec == 1 && kRounds % 2 == 0, "two register sets of one vector");
    for (int t = first; t < kTokens; t += step) {
      const int pair_row = lane < kTopk ? rows[t * kTopk + lane] : 0;
      const int4* src[kTopk];
#pragma unroll
      for (int q = 0; q < kTopk; ++q) {
        src[q] = y + static_cast<size_t>(__shfl_sync(~0u, pair_row, q)) * kVecPerRow + lane;
      }
      int4* dst = out + static_cast<size_t>(t) * kVecPerRow + lane;
      int4 a[kTopk], b[kTopk];
      auto load = [&](int4(&r)[kTopk], int base) {
#pragma unroll
        for (int q = 0; q < kTopk; ++q) r[q] = ld_v4_no_alloc(src[q] + base, false);
      };
      auto sum = [&](const int4(&r)[kTopk], int base) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int q = 0; q < kTopk; ++q) add_bf16x8(acc, r[q]);
        st_na_v4(dst + base, round_bf16x8(acc));
      };
      load(a, 0);
      for (int base = 0; base < kVecPerRow; base += 64) {
        load(b, base + 32);
        sum(a, base);
        if (base + 64 < kVecPerRow) load(a, base + 64);
        sum(b, base + 32);
      }
    }
  } else if constexpr (D == Design::kAsync) {
    // Lane-private slots: lane L's vector u of row q in stage s, read back by
    // lane L alone after its own cp.async.wait_group (no warp barrier).
    extern __shared__ __align__(16) int4 ring[];
    int4* slots = ring + static_cast<size_t>(warp) * kStages * kTopk * kRound;
    auto slot = [&](int s, int q, int u) {
      return slots + ((s * kTopk + q) * kVec + u) * 32 + lane;
    };
    const int my_tokens = first < kTokens ? (kTokens - 1 - first) / step + 1 : 0;
    const int total = my_tokens * kRounds;
    int issue_token = -1, pair_row = 0;
    auto issue = [&](int i) {
      if (i < total) {
        const int t = first + (i / kRounds) * step, base = (i % kRounds) * kRound;
        if (t != issue_token) {
          issue_token = t;
          pair_row = lane < kTopk ? rows[t * kTopk + lane] : 0;
        }
#pragma unroll
        for (int q = 0; q < kTopk; ++q) {
          const int row = __shfl_sync(~0u, pair_row, q);
          const int4* src = y + static_cast<size_t>(row) * kVecPerRow + base;
#pragma unroll
          for (int u = 0; u < kVec; ++u) cp_async_16(slot(i % kStages, q, u), src + u * 32 + lane);
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int i = 0; i < kStages - 1; ++i) issue(i);
    for (int i = 0; i < total; ++i) {
      issue(i + kStages - 1);
      asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1) : "memory");
      const int t = first + (i / kRounds) * step, base = (i % kRounds) * kRound;
#pragma unroll
      for (int u = 0; u < kVec; ++u) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
        for (int q = 0; q < kTopk; ++q) add_bf16x8(acc, *slot(i % kStages, q, u));
        st_na_v4(out + static_cast<size_t>(t) * kVecPerRow + base + u * 32 + lane,
                 round_bf16x8(acc));
      }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
  } else if constexpr (D == Design::kDynamic) {  // expand, tokens from g_next_token
    auto take = [&] {
      unsigned int t = 0;
      if (lane == 0) t = atomicAdd(&g_next_token, 1u);
      return static_cast<int>(__shfl_sync(~0u, t, 0));
    };
    int t = take();
    while (t < kTokens) {
      const int pair_row = lane < kTopk ? rows[t * kTopk + lane] : 0;
      const int next = take();  // in flight while this token's rows go out
      for (int base = 0; base < kVecPerRow; base += kRound) {
        int4 v[kVec];
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          v[u] = ld_v4_no_alloc(x + static_cast<size_t>(t) * kVecPerRow + base + u * 32 + lane,
                                false);
        }
#pragma unroll
        for (int q = 0; q < kTopk; ++q) {
          int4* dst = out + static_cast<size_t>(__shfl_sync(~0u, pair_row, q)) * kVecPerRow + base;
#pragma unroll
          for (int u = 0; u < kVec; ++u) st_na_v4(dst + u * 32 + lane, v[u]);
        }
      }
      t = next;
    }
    // Every warp has taken its last token (one past the end) before it
    // counts itself done; the last one resets the counters for the next launch.
    if (lane == 0 && atomicAdd(&g_warps_done, 1u) == gridDim.x * kWarps - 1) {
      g_warps_done = 0;
      g_next_token = 0;
    }
  } else {  // kExpand, kWrite, kRanges, kMeta: x[t] to each of t's pair rows (out: pair rows)
    constexpr bool kSplit = D == Design::kRanges || D == Design::kMeta;
    const int range = (kTokens + gridDim.x - 1) / gridDim.x;
    const int t0 = kSplit ? blockIdx.x * range + warp : first;
    const int t_end = kSplit ? min(kTokens, static_cast<int>(blockIdx.x + 1) * range) : kTokens;
    const int t_step = kSplit ? kWarps : step;
    for (int t = t0; t < t_end; t += t_step) {
      const int pair_row = lane < kTopk ? rows[t * kTopk + lane] : 0;
      for (int base = 0; base < kVecPerRow; base += kRound) {
        int4 v[kVec];
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
          v[u] = D == Design::kWrite ? make_int4(t, base, u, lane)
                                     : ld_v4_no_alloc(x + static_cast<size_t>(t) * kVecPerRow +
                                                          base + u * 32 + lane,
                                                      false);
        }
#pragma unroll
        for (int q = 0; q < kTopk; ++q) {
          int4* dst = out + static_cast<size_t>(__shfl_sync(~0u, pair_row, q)) * kVecPerRow + base;
#pragma unroll
          for (int u = 0; u < kVec; ++u) st_na_v4(dst + u * 32 + lane, v[u]);
        }
      }
      if constexpr (D == Design::kMeta) {  // sink: [kPairs] x 3 words, then [kPairs] x 2
        if (lane < kTopk) {
          sink[pair_row] = lane;
          sink[kPairs + pair_row] = __float_as_int(0.125f * lane);
          sink[2 * kPairs + pair_row] = t;
          sink[3 * kPairs + t * kTopk + lane] = pair_row;
          sink[4 * kPairs + t * kTopk + lane] = pair_row;
        }
      }
    }
  }
  if constexpr (D == Design::kFold) sink[blockIdx.x * kThreads + threadIdx.x] = folded;
  __syncthreads();
  if (threadIdx.x == 0 && blockIdx.x < kMaxGrid) {
    g_block_times[2 * blockIdx.x + 1] = jax_ep::cuda::global_timer_ns();
  }
}

__global__ void fill_bf16(uint16_t* y, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // sign, exponent 2^-8 .. 2^7, any mantissa: finite, with rounding in the sums
    y[i] = static_cast<uint16_t>((h & 0x807fu) | ((119u + (h >> 8) % 16u) << 7));
  }
}

static float bf16_to_float(uint16_t b) {
  uint32_t w = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}
static uint16_t float_to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, 4);
  return static_cast<uint16_t>((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

using Kernel = void (*)(const int4*, const int*, const int4*, int4*, int*);

struct Result {
  const char* name;
  int threads, vec, stages, grid;
  float us, min_us;
  double gbps_per_sm;
  bool ok;
  float end_spread_us, span_us;  // last launch, expanding designs (else 0)
};

int main(int argc, char** argv) {
  const char* json_path = argc > 1 ? argv[1] : nullptr;
  setvbuf(stdout, nullptr, _IONBF, 0);
  if (cudaSetDevice(0) != cudaSuccess) return 2;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  // Routing: 8 distinct experts per token, ascending; pair rows grouped by
  // expert, in token order within an expert (the kernels' layout at A = 1).
  std::mt19937 rng(20261204);
  std::vector<int> experts(static_cast<size_t>(kPairs));
  std::vector<int> pool(kExperts);
  std::iota(pool.begin(), pool.end(), 0);
  for (int t = 0; t < kTokens; ++t) {
    for (int k = 0; k < kTopk; ++k) std::swap(pool[k], pool[k + rng() % (kExperts - k)]);
    std::sort(pool.begin(), pool.begin() + kTopk);
    std::copy(pool.begin(), pool.begin() + kTopk, experts.begin() + t * kTopk);
  }
  std::vector<int> offset(kExperts + 1, 0);
  for (int e : experts) ++offset[e + 1];
  for (int e = 0; e < kExperts; ++e) offset[e + 1] += offset[e];
  std::vector<int> fill(offset.begin(), offset.end() - 1);
  std::vector<int> rows(static_cast<size_t>(kPairs)), contig(static_cast<size_t>(kPairs));
  for (int i = 0; i < kPairs; ++i) {
    rows[i] = fill[experts[i]]++;
    contig[i] = i;
  }
  const size_t row_bytes = static_cast<size_t>(kVecPerRow) * 16;
  const size_t pair_bytes = static_cast<size_t>(kPairs) * row_bytes;
  const size_t token_bytes = static_cast<size_t>(kTokens) * row_bytes;
  int4 *y, *x, *out, *pairs_out;
  int *d_rows, *d_contig, *sink;
  if (cudaMalloc(&y, pair_bytes) || cudaMalloc(&x, token_bytes) || cudaMalloc(&out, token_bytes) ||
      cudaMalloc(&pairs_out, pair_bytes) || cudaMalloc(&d_rows, kPairs * sizeof(int)) ||
      cudaMalloc(&d_contig, kPairs * sizeof(int)) || cudaMalloc(&sink, 5 * kPairs * sizeof(int))) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 2;
  }
  fill_bf16<<<528, 512>>>(reinterpret_cast<uint16_t*>(y), pair_bytes / 2, 1u);
  fill_bf16<<<528, 512>>>(reinterpret_cast<uint16_t*>(x), token_bytes / 2, 2u);
  cudaMemcpy(d_rows, rows.data(), kPairs * sizeof(int), cudaMemcpyHostToDevice);
  cudaMemcpy(d_contig, contig.data(), kPairs * sizeof(int), cudaMemcpyHostToDevice);
  std::vector<uint16_t> h_y(pair_bytes / 2), h_x(token_bytes / 2);
  cudaMemcpy(h_y.data(), y, pair_bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(h_x.data(), x, token_bytes, cudaMemcpyDeviceToHost);
  std::vector<uint16_t> want(token_bytes / 2);
  for (int t = 0; t < kTokens; ++t) {
    for (int c = 0; c < kHidden; ++c) {
      float acc = 0.0f;
      for (int k = 0; k < kTopk; ++k) {
        acc += bf16_to_float(h_y[static_cast<size_t>(rows[t * kTopk + k]) * kHidden + c]);
      }
      want[static_cast<size_t>(t) * kHidden + c] = float_to_bf16(0.0f + acc);
    }
  }
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  std::vector<Result> results;
  std::vector<uint16_t> got(pair_bytes / 2);
  auto run = [&](const char* name, Design design, Kernel kernel, int threads, int vec, int stages,
                 int grid, bool contiguous) {
    const bool expands = design == Design::kExpand || design == Design::kWrite ||
                         design == Design::kRanges || design == Design::kMeta ||
                         design == Design::kDynamic;
    const size_t smem = design == Design::kAsync
                            ? static_cast<size_t>(threads / 32) * stages * kTopk * vec * 32 * 16
                            : 0;
    if (smem > 48 * 1024) {
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem));
    }
    int4* dst = expands ? pairs_out : out;
    const int* idx = contiguous ? d_contig : d_rows;
    cudaMemsetAsync(dst, 0xff, expands ? pair_bytes : token_bytes, stream);
    const std::vector<float> per = time_launches(
        [&] { kernel<<<grid, threads, smem, stream>>>(y, idx, x, dst, sink); }, stream, 3, 7, 10);
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    bool ok = err == cudaSuccess;
    if (ok && !contiguous && design != Design::kFold && design != Design::kWrite) {
      if (expands) {
        cudaMemcpy(got.data(), pairs_out, pair_bytes, cudaMemcpyDeviceToHost);
        for (int i = 0; ok && i < kPairs; ++i) {
          ok = std::memcmp(&got[static_cast<size_t>(rows[i]) * kHidden],
                           &h_x[static_cast<size_t>(i / kTopk) * kHidden], row_bytes) == 0;
        }
      } else {
        cudaMemcpy(got.data(), out, token_bytes, cudaMemcpyDeviceToHost);
        ok = std::memcmp(got.data(), want.data(), token_bytes) == 0;
      }
    }
    const double us = per[3];
    const double gbps = pair_bytes / (us * 1e-6) / 1e9 / grid;
    float end_spread = 0.0f, span = 0.0f;
    if (expands && grid <= kMaxGrid) {
      unsigned long long times[2 * kMaxGrid];
      cudaMemcpyFromSymbol(times, g_block_times, sizeof(unsigned long long) * 2 * grid);
      unsigned long long first_start = ~0ull, first_end = ~0ull, last_end = 0;
      for (int b = 0; b < grid; ++b) {
        first_start = std::min(first_start, times[2 * b]);
        first_end = std::min(first_end, times[2 * b + 1]);
        last_end = std::max(last_end, times[2 * b + 1]);
      }
      end_spread = (last_end - first_end) / 1e3f;
      span = (last_end - first_start) / 1e3f;
    }
    printf("%-7s %4d thr vec %d stages %d%s grid %3d: %7.1f us (min %7.1f) "
           "%6.1f GB/s pairs per SM, block ends spread %5.1f us of %6.1f %s%s\n",
           name, threads, vec, stages, contiguous ? " contig" : "", grid, us, per[0], gbps,
           end_spread, span, ok ? "ok" : "WRONG ", err ? cudaGetErrorString(err) : "");
    results.push_back({contiguous ? "contig" : name, threads, vec, stages, grid,
                       static_cast<float>(us), per[0], gbps, ok, end_spread, span});
  };
  for (int grid : {24, 8}) {
    run("regs", Design::kRegs, pair_rows<512, 2, Design::kRegs, 0>, 512, 2, 0, grid, false);
    run("regs", Design::kRegs, pair_rows<1024, 1, Design::kRegs, 0>, 1024, 1, 0, grid, false);
    run("fold", Design::kFold, pair_rows<512, 2, Design::kFold, 0>, 512, 2, 0, grid, false);
    run("regs", Design::kRegs, pair_rows<512, 2, Design::kRegs, 0>, 512, 2, 0, grid, true);
    run("pipe", Design::kPipe, pair_rows<512, 1, Design::kPipe, 0>, 512, 1, 0, grid, false);
    run("async", Design::kAsync, pair_rows<512, 1, Design::kAsync, 3>, 512, 1, 3, grid, false);
    run("async", Design::kAsync, pair_rows<384, 1, Design::kAsync, 4>, 384, 1, 4, grid, false);
    run("async", Design::kAsync, pair_rows<256, 1, Design::kAsync, 6>, 256, 1, 6, grid, false);
    run("async", Design::kAsync, pair_rows<256, 2, Design::kAsync, 3>, 256, 2, 3, grid, false);
    run("expand", Design::kExpand, pair_rows<512, 14, Design::kExpand, 0>, 512, 14, 0, grid, false);
    run("expand", Design::kExpand, pair_rows<512, 4, Design::kExpand, 0>, 512, 4, 0, grid, false);
    run("write", Design::kWrite, pair_rows<512, 14, Design::kWrite, 0>, 512, 14, 0, grid, false);
    run("ranges", Design::kRanges, pair_rows<512, 14, Design::kRanges, 0>, 512, 14, 0, grid, false);
    run("meta", Design::kMeta, pair_rows<512, 14, Design::kMeta, 0>, 512, 14, 0, grid, false);
    run("dynamic", Design::kDynamic, pair_rows<512, 14, Design::kDynamic, 0>, 512, 14, 0, grid,
        false);
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f != nullptr) {
      std::fprintf(f,
                   "{\n \"mode\": \"pair-combine-probe\",\n \"device\": \"%s\",\n"
                   " \"tokens\": %d,\n \"hidden\": %d,\n \"topk\": %d,\n \"experts\": %d,\n"
                   " \"timing\": \"3 warm-ups, then 7 repeats of 10 launches on one stream;"
                   " median and min per launch, us; GB/s of pair rows (470 MB) per SM\",\n"
                   " \"results\": [\n",
                   prop.name, kTokens, kHidden, kTopk, kExperts);
      for (size_t i = 0; i < results.size(); ++i) {
        const Result& r = results[i];
        std::fprintf(f,
                     "  {\"design\": \"%s\", \"threads\": %d, \"vec\": %d, \"stages\": %d, "
                     "\"grid\": %d, \"us\": %.2f, \"min_us\": %.2f, \"pairs_gbps_per_sm\": %.1f, "
                     "\"block_end_spread_us\": %.1f, \"block_span_us\": %.1f, "
                     "\"correct\": %s}%s\n",
                     r.name, r.threads, r.vec, r.stages, r.grid, r.us, r.min_us, r.gbps_per_sm,
                     r.end_spread_us, r.span_us, r.ok ? "true" : "false",
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
