// A warp's float32 sums of one staging row's pair rows (the expert-major
// combine's partial, ht_pair_combine.cu), with the next step's loads in flight
// while this step is summed.
//
// Round i of a row covers vectors i*32 + lane of the pass. With up to
// kPairGroup (8) pairs, the common case, lane L loads one 16-byte vector of
// each pair row of a round into one of two register sets; round i+1's loads
// are issued before round i is summed, so a warp always has a round in flight
// (4 KB) while it adds, converts and stores. (More pairs, more than 8 local
// experts per token, take groups of 8 one after the other, unpipelined.) Measured
// against loading a batch and then summing it, the way the kernel had before
// (tools/pair_combine_probe.cu, 2026-12-04, one H200, 24 SMs, 8 pairs of 14 KB
// per token): 184 against 226 us.
//
// Pair rows past the list (a group's rows beyond num_pairs) and vectors past
// the pass load as zeros, and every round adds all kPairGroup vectors: a sum
// that starts at +0.0f never becomes -0.0f (x + y is -0.0f under round to
// nearest only when both are -0.0f), so adding +0.0f leaves it bit for bit
// as it was (a NaN stays a NaN). The sums are those of the pair list in its
// order: 0.0f + y[p_0] + y[p_1] + ...
#ifndef JAX_EP_CUDA_HT_PAIR_SUM_CUH_
#define JAX_EP_CUDA_HT_PAIR_SUM_CUH_

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/device_common.cuh"
#include "cuda/ht_row_elements.cuh"

namespace jax_ep::cuda {

constexpr int kPairGroup = 8;

// Columns of one pass, in whole vectors of the row type.
struct PairPass {
  int first_vector;
  int num_vectors;
};

// *v = the 16 bytes at ptr if load, else zeros: one predicated load into
// zeroed registers (no copy out of a scratch vector).
__device__ __forceinline__ void ld_v4_or_zero(int4* v, const int4* ptr, bool load) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %5, 0;\n"
      " mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n"
      " @p ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];\n}"
      : "=r"(v->x), "=r"(v->y), "=r"(v->z), "=r"(v->w)
      : "l"(ptr), "r"(static_cast<int>(load)));
}

// Calls emit(v, acc) once per round, in round order, with v = round*32 + lane
// (v may be past the pass: emit skips those) and acc[j] = 0.0f + element j of
// vector v of pair rows p_0, p_1, ... p_{n-1} (n = num_pairs, 0 <= n <= 32;
// lane j < n holds p_j in pair_row). Every lane of the warp calls it.
template <typename T, typename Emit>
__device__ __forceinline__ void for_each_pair_sum(const char* y, size_t row_stride,
                                                  const PairPass& pass, int pair_row,
                                                  int num_pairs, int lane, Emit&& emit) {
  using E = RowElements<T>;
  const int rounds = (pass.num_vectors + kWarpSize - 1) / kWarpSize;
  float acc[E::kPerVector];
  // Lane's first vector of pair row k (k < num_pairs).
  auto row_of = [&](int k) {
    const int row = __shfl_sync(0xffffffffu, pair_row, k % kWarpSize);
    return reinterpret_cast<const int4*>(y + static_cast<size_t>(k < num_pairs ? row : 0) *
                                                 row_stride) +
           pass.first_vector + lane;
  };
  if (num_pairs > kPairGroup) {  // rare (more than 8 local experts per token): no pipeline
    for (int round = 0; round < rounds; ++round) {
      const int v = round * kWarpSize + lane;
#pragma unroll
      for (int j = 0; j < E::kPerVector; ++j) acc[j] = 0.0f;
      for (int group = 0; group * kPairGroup < num_pairs; ++group) {
        int4 raw[kPairGroup];
#pragma unroll
        for (int q = 0; q < kPairGroup; ++q) {
          const int k = group * kPairGroup + q;
          ld_v4_or_zero(&raw[q], row_of(k) + round * kWarpSize,
                        k < num_pairs && v < pass.num_vectors);
        }
#pragma unroll
        for (int q = 0; q < kPairGroup; ++q) E::add(acc, raw[q]);
      }
      emit(v, acc);
    }
    return;
  }
  // Up to 8 pairs: each row's address once, and two register sets.
  const int4* rows[kPairGroup];
#pragma unroll
  for (int q = 0; q < kPairGroup; ++q) rows[q] = row_of(q);
  auto load = [&](int4(&raw)[kPairGroup], int round) {
    const bool in_pass = round * kWarpSize + lane < pass.num_vectors;
#pragma unroll
    for (int q = 0; q < kPairGroup; ++q) {
      ld_v4_or_zero(&raw[q], rows[q] + round * kWarpSize, in_pass && q < num_pairs);
    }
  };
  auto sum = [&](const int4(&raw)[kPairGroup], int round) {
#pragma unroll
    for (int j = 0; j < E::kPerVector; ++j) acc[j] = 0.0f;
#pragma unroll
    for (int q = 0; q < kPairGroup; ++q) E::add(acc, raw[q]);
    emit(round * kWarpSize + lane, acc);
  };
  int4 a[kPairGroup], b[kPairGroup];
  if (rounds > 0) load(a, 0);
  for (int round = 0; round < rounds; round += 2) {
    if (round + 1 < rounds) load(b, round + 1);
    sum(a, round);
    if (round + 2 < rounds) load(a, round + 2);
    if (round + 1 < rounds) sum(b, round + 1);
  }
}

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_PAIR_SUM_CUH_
