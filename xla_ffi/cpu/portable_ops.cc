#include "xla_ffi/cpu/portable_ops.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace jax_ep::cpu {
namespace {

// bf16 <-> f32 with round-to-nearest-even (NaN kept quiet).
inline float Bf16ToF32(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t F32ToBf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  uint32_t rounding_bias = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding_bias) >> 16);
}

// IEEE binary16 <-> f32, round-to-nearest-even, subnormals handled.
inline float F16ToF32(uint16_t bits) {
  uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t word;
  if (exponent == 0x1f) {
    word = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    word = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    word = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      ++shift;
    }
    mantissa &= 0x3ffu;
    word = sign | (static_cast<uint32_t>(113 - shift) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t F32ToF16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  uint16_t sign = static_cast<uint16_t>((word >> 16) & 0x8000u);
  uint32_t abs_word = word & 0x7fffffffu;
  if (abs_word > 0x7f800000u) return sign | 0x7e00u;            // NaN
  if (abs_word >= 0x477ff000u) return sign | 0x7c00u;           // overflow -> inf
  if (abs_word < 0x38800000u) {                                 // f16 subnormal or zero
    if (abs_word < 0x33000000u) return sign;                    // below half the smallest subnormal
    uint32_t exponent = abs_word >> 23;
    uint32_t mantissa = (abs_word & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(exponent);               // 14 + (113 - exponent) - 1
    uint32_t half_mantissa = mantissa >> shift;
    uint32_t remainder = mantissa & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return sign | static_cast<uint16_t>(half_mantissa);
  }
  uint32_t rounded = abs_word + 0xfffu + ((abs_word >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - (112u << 23)) >> 13);
}

template <FloatKind kKind>
inline float Load(const void* base, int64_t i) {
  if constexpr (kKind == FloatKind::kF32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (kKind == FloatKind::kBF16) {
    return Bf16ToF32(static_cast<const uint16_t*>(base)[i]);
  } else {
    return F16ToF32(static_cast<const uint16_t*>(base)[i]);
  }
}

template <FloatKind kKind>
inline void Store(void* base, int64_t i, float value) {
  if constexpr (kKind == FloatKind::kF32) {
    static_cast<float*>(base)[i] = value;
  } else if constexpr (kKind == FloatKind::kBF16) {
    static_cast<uint16_t*>(base)[i] = F32ToBf16(value);
  } else {
    static_cast<uint16_t*>(base)[i] = F32ToF16(value);
  }
}

template <FloatKind kKind>
void GatherReduceTyped(const void* src, int64_t num_src_rows, int64_t row_elems,
                       const int32_t* index, const float* weights,
                       int64_t num_out_rows, int64_t index_width, void* out) {
  std::vector<float> accumulator(static_cast<size_t>(row_elems));
  for (int64_t n = 0; n < num_out_rows; ++n) {
    std::fill(accumulator.begin(), accumulator.end(), 0.0f);
    for (int64_t m = 0; m < index_width; ++m) {
      int32_t row = index[n * index_width + m];
      if (row < 0 || row >= num_src_rows) continue;
      float weight = weights[n * index_width + m];
      int64_t base = static_cast<int64_t>(row) * row_elems;
      for (int64_t h = 0; h < row_elems; ++h) {
        accumulator[h] += weight * Load<kKind>(src, base + h);
      }
    }
    for (int64_t h = 0; h < row_elems; ++h) {
      Store<kKind>(out, n * row_elems + h, accumulator[h]);
    }
  }
}

}  // namespace

int32_t Layout(const int32_t* topk_idx, int64_t num_tokens, int64_t num_topk,
               int64_t num_experts, int64_t num_ranks, int32_t* clean_idx,
               int32_t* tokens_per_rank, int32_t* tokens_per_expert,
               bool* is_token_in_rank, int64_t* first_invalid) {
  const int64_t experts_per_rank = num_experts / num_ranks;
  std::fill(tokens_per_rank, tokens_per_rank + num_ranks, 0);
  std::fill(tokens_per_expert, tokens_per_expert + num_experts, 0);
  std::fill(is_token_in_rank, is_token_in_rank + num_tokens * num_ranks, false);
  int32_t num_invalid = 0;
  *first_invalid = -1;
  std::vector<int32_t> seen_experts;
  for (int64_t t = 0; t < num_tokens; ++t) {
    seen_experts.clear();
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t flat = t * num_topk + k;
      int32_t expert = topk_idx[flat];
      if (expert < -1 || expert >= num_experts) {
        if (num_invalid == 0) *first_invalid = flat;
        ++num_invalid;
        expert = -1;
      }
      clean_idx[flat] = expert;
      if (expert < 0) continue;
      if (std::find(seen_experts.begin(), seen_experts.end(), expert) != seen_experts.end()) continue;
      seen_experts.push_back(expert);
      ++tokens_per_expert[expert];
      const int64_t rank = expert / experts_per_rank;
      bool& in_rank = is_token_in_rank[t * num_ranks + rank];
      if (!in_rank) {
        in_rank = true;
        ++tokens_per_rank[rank];
      }
    }
  }
  return num_invalid;
}

void HtRoute(const int32_t* clean_idx, const float* weights, int64_t num_tokens,
             int64_t num_topk, int64_t num_ranks, int64_t experts_per_rank,
             int64_t capacity, const int32_t* row_offset, int32_t* send_idx,
             float* send_w, int32_t* send_slot, int32_t* send_row) {
  std::vector<int64_t> next_row(row_offset, row_offset + num_ranks);
  for (int64_t r = 0; r < num_ranks; ++r) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      bool in_rank = false;
      for (int64_t k = 0; k < num_topk; ++k) {
        const int32_t expert = clean_idx[t * num_topk + k];
        const bool mine = expert >= 0 && expert / experts_per_rank == r;
        const int64_t out = (r * num_tokens + t) * num_topk + k;
        send_idx[out] = mine ? static_cast<int32_t>(expert - r * experts_per_rank) : -1;
        send_w[out] = mine ? weights[t * num_topk + k] : 0.0f;
        in_rank |= mine;
      }
      send_slot[t * num_ranks + r] = in_rank ? static_cast<int32_t>(r * num_tokens + t) : -1;
      int32_t row = -1;
      if (in_rank) {
        if (next_row[r] < capacity) row = static_cast<int32_t>(next_row[r]);
        ++next_row[r];
      }
      send_row[t * num_ranks + r] = row;
    }
  }
}

void HtCompact(const int32_t* recv_idx, const float* recv_w, int64_t num_ranks,
               int64_t num_tokens_per_rank, int64_t num_topk,
               int64_t experts_per_rank, int64_t capacity, int32_t* recv_src,
               int32_t* out_idx, float* out_w, int32_t* tokens_per_expert,
               int32_t* num_tokens, int32_t* num_dropped) {
  std::fill(recv_src, recv_src + capacity, -1);
  std::fill(out_idx, out_idx + capacity * num_topk, -1);
  std::fill(out_w, out_w + capacity * num_topk, 0.0f);
  std::fill(tokens_per_expert, tokens_per_expert + experts_per_rank, 0);
  int64_t received = 0;
  std::vector<bool> counted(static_cast<size_t>(experts_per_rank));
  const int64_t num_sources = num_ranks * num_tokens_per_rank;
  for (int64_t src = 0; src < num_sources; ++src) {
    const int32_t* idx = recv_idx + src * num_topk;
    bool present = false;
    for (int64_t k = 0; k < num_topk; ++k) present |= idx[k] >= 0;
    if (!present) continue;
    const int64_t row = received++;
    if (row >= capacity) continue;
    recv_src[row] = static_cast<int32_t>(src);
    std::fill(counted.begin(), counted.end(), false);
    for (int64_t k = 0; k < num_topk; ++k) {
      out_idx[row * num_topk + k] = idx[k];
      out_w[row * num_topk + k] = recv_w[src * num_topk + k];
      if (idx[k] >= 0 && idx[k] < experts_per_rank && !counted[idx[k]]) {
        counted[idx[k]] = true;
        ++tokens_per_expert[idx[k]];
      }
    }
  }
  *num_tokens = static_cast<int32_t>(std::min(received, capacity));
  *num_dropped = static_cast<int32_t>(received - *num_tokens);
}

void LlRoute(const int32_t* clean_idx, int64_t num_tokens, int64_t num_topk,
             int64_t num_experts, int32_t* send_slot, int32_t* send_mask) {
  std::fill(send_mask, send_mask + num_experts * num_tokens, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < num_topk; ++k) {
      const int32_t expert = clean_idx[t * num_topk + k];
      int32_t slot = -1;
      if (expert >= 0 && expert < num_experts) {
        int32_t& mask = send_mask[expert * num_tokens + t];
        if (!mask) {
          mask = 1;
          slot = static_cast<int32_t>(expert * num_tokens + t);
        }
      }
      send_slot[t * num_topk + k] = slot;
    }
  }
}

void LlCompact(const int32_t* recv_mask, int64_t num_ranks,
               int64_t experts_per_rank, int64_t num_tokens_per_rank,
               int64_t rows_per_expert, int32_t* recv_src, int32_t* count,
               int32_t* gather_index) {
  std::fill(recv_src, recv_src + experts_per_rank * rows_per_expert, -1);
  std::fill(gather_index, gather_index + experts_per_rank * rows_per_expert, -1);
  for (int64_t e = 0; e < experts_per_rank; ++e) {
    int64_t rows = 0;
    for (int64_t s = 0; s < num_ranks; ++s) {
      for (int64_t t = 0; t < num_tokens_per_rank; ++t) {
        const int64_t flat = (s * experts_per_rank + e) * num_tokens_per_rank + t;
        if (!recv_mask[flat] || rows >= rows_per_expert) continue;
        recv_src[e * rows_per_expert + rows] = static_cast<int32_t>(s * num_tokens_per_rank + t);
        gather_index[e * rows_per_expert + rows] = static_cast<int32_t>(flat);
        ++rows;
      }
    }
    count[e] = static_cast<int32_t>(rows);
  }
}

void ScatterRows(const void* src, int64_t num_src_rows, int64_t row_bytes,
                 const int32_t* index, int64_t index_width, void* out,
                 int64_t num_out_rows) {
  auto* out_bytes = static_cast<char*>(out);
  const auto* src_bytes = static_cast<const char*>(src);
  std::memset(out_bytes, 0, static_cast<size_t>(num_out_rows * row_bytes));
  for (int64_t n = 0; n < num_src_rows; ++n) {
    for (int64_t m = 0; m < index_width; ++m) {
      const int32_t row = index[n * index_width + m];
      if (row < 0 || row >= num_out_rows) continue;
      std::memcpy(out_bytes + row * row_bytes, src_bytes + n * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  }
}

void GatherRows(const void* src, int64_t num_src_rows, int64_t row_bytes,
                const int32_t* index, int64_t num_out_rows, void* out) {
  auto* out_bytes = static_cast<char*>(out);
  const auto* src_bytes = static_cast<const char*>(src);
  for (int64_t n = 0; n < num_out_rows; ++n) {
    const int32_t row = index[n];
    if (row < 0 || row >= num_src_rows) {
      std::memset(out_bytes + n * row_bytes, 0, static_cast<size_t>(row_bytes));
    } else {
      std::memcpy(out_bytes + n * row_bytes, src_bytes + row * row_bytes,
                  static_cast<size_t>(row_bytes));
    }
  }
}

void GatherReduce(FloatKind kind, const void* src, int64_t num_src_rows,
                  int64_t row_elems, const int32_t* index, const float* weights,
                  int64_t num_out_rows, int64_t index_width, void* out) {
  switch (kind) {
    case FloatKind::kF32:
      GatherReduceTyped<FloatKind::kF32>(src, num_src_rows, row_elems, index, weights,
                                         num_out_rows, index_width, out);
      break;
    case FloatKind::kBF16:
      GatherReduceTyped<FloatKind::kBF16>(src, num_src_rows, row_elems, index, weights,
                                          num_out_rows, index_width, out);
      break;
    case FloatKind::kF16:
      GatherReduceTyped<FloatKind::kF16>(src, num_src_rows, row_elems, index, weights,
                                         num_out_rows, index_width, out);
      break;
  }
}

}  // namespace jax_ep::cpu
