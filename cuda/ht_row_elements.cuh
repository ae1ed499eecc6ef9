// Elements of the HT combines' 16-byte row vectors as float32 (ht_combine.cu,
// ht_pair_combine.cu): bf16, f16 and f32 rows, summed in fp32, stored back in
// their own type with round-to-nearest-even.
#ifndef JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_
#define JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace jax_ep::cuda {

// Elements of a 16-byte vector of combine rows, as fp32: get/set one element;
// add(acc, v) adds every element to acc (acc[j] += get(v, j), the same values);
// pack(acc) is the vector of set(v, j, acc[j]) (the same rounding).
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
  // acc[j] += element j: a bf16 is the top half of its float32, so each
  // element is one shift or mask (the same values as get()).
  __device__ static void add(float (&acc)[kPerVector], const int4& v) {
    const uint32_t w[4] = {static_cast<uint32_t>(v.x), static_cast<uint32_t>(v.y),
                           static_cast<uint32_t>(v.z), static_cast<uint32_t>(v.w)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] += __uint_as_float(w[i] << 16);
      acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  // The vector of acc rounded to nearest even, two elements per conversion.
  __device__ static int4 pack(const float (&acc)[kPerVector]) {
    int4 v;
    auto* pairs = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    return v;
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
  __device__ static void add(float (&acc)[kPerVector], const int4& v) {
    const auto* pairs = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(pairs[i]);
      acc[2 * i] += f.x;
      acc[2 * i + 1] += f.y;
    }
  }
  __device__ static int4 pack(const float (&acc)[kPerVector]) {
    int4 v;
    auto* pairs = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2half2_rn(acc[2 * i], acc[2 * i + 1]);
    return v;
  }
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
  __device__ static void add(float (&acc)[kPerVector], const int4& v) {
    acc[0] += __int_as_float(v.x);
    acc[1] += __int_as_float(v.y);
    acc[2] += __int_as_float(v.z);
    acc[3] += __int_as_float(v.w);
  }
  __device__ static int4 pack(const float (&acc)[kPerVector]) {
    return make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]),
                     __float_as_int(acc[3]));
  }
};

}  // namespace jax_ep::cuda

#endif  // JAX_EP_CUDA_HT_ROW_ELEMENTS_CUH_
