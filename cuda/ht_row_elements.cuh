// Elements of the HT combines' 16-byte row vectors as float32 (ht_kernels.cu,
// ht_pair_combine.cu): bf16, f16 and f32 rows, summed in fp32, stored back in
// their own type with round-to-nearest-even.
#ifndef JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_
#define JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace jax_ep::cuda {

// Elements of a 16-byte vector of combine rows, as fp32.
template <typename T>
struct RowElements;
// plus_zero(v): each element plus +0 in its own type, the one-source sum of
// the one-rank combine (0.0f + x in fp32, rounded back) in one packed add per
// pair of 2-byte elements: the same bits for every number (x itself, -0
// becomes +0; a NaN stays a NaN, its payload bits not checked) in about a
// fifth of the float path's instructions. With it,
// the loads a token ahead and no last block, the one-rank combine kernel went
// from 62.5 to 56.9 us (2026-12-01, docs/benchmarks.md; the add's own share was
// not measured apart).
template <typename Pair>
__device__ __forceinline__ int4 plus_zero_pairs(int4 v, Pair zero) {
  auto* pairs = reinterpret_cast<Pair*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __hadd2(pairs[i], zero);
  return v;
}
template <>
struct RowElements<__nv_bfloat16> {
  static constexpr int kPerVector = 8;
  __device__ static float get(const int4& v, int j) {
    return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(&v)[j]);
  }
  __device__ static void set(int4& v, int j, float x) {
    reinterpret_cast<__nv_bfloat16*>(&v)[j] = __float2bfloat16_rn(x);
  }
  __device__ static int4 plus_zero(int4 v) {
    return plus_zero_pairs(v, __float2bfloat162_rn(0.0f));
  }
};
template <>
struct RowElements<__half> {
  static constexpr int kPerVector = 8;
  __device__ static float get(const int4& v, int j) {
    return __half2float(reinterpret_cast<const __half*>(&v)[j]);
  }
  __device__ static void set(int4& v, int j, float x) {
    reinterpret_cast<__half*>(&v)[j] = __float2half_rn(x);
  }
  __device__ static int4 plus_zero(int4 v) { return plus_zero_pairs(v, __float2half2_rn(0.0f)); }
};
template <>
struct RowElements<float> {
  static constexpr int kPerVector = 4;
  __device__ static float get(const int4& v, int j) { return reinterpret_cast<const float*>(&v)[j]; }
  __device__ static void set(int4& v, int j, float x) { reinterpret_cast<float*>(&v)[j] = x; }
  __device__ static int4 plus_zero(int4 v) {
    auto* x = reinterpret_cast<float*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __fadd_rn(0.0f, x[i]);
    return v;
  }
};

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_
