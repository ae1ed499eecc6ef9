#include "xla_ffi/cpu/cpu_handlers.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/cpu/portable_ops.h"
#include "xla_ffi/exports.h"

namespace jax_ep::cpu {
namespace {

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

ffi::Error Invalid(const std::string& target, const std::string& message) {
  return ffi::Error::InvalidArgument("jax_ep " + target + ": " + message);
}

// Product of all dimensions after the first (bytes or elements of one row).
int64_t TrailingCount(ffi::Span<const int64_t> dims) {
  int64_t count = 1;
  for (size_t i = 1; i < dims.size(); ++i) count *= dims[i];
  return count;
}

bool SameTrailing(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 1; i < a.size(); ++i) {
    if (a[i] != b[i]) return false;
  }
  return true;
}

// ---------------------------------------------------------------- layout
}  // namespace

ffi::Error LayoutImpl(ffi::Buffer<ffi::S32> topk_idx, int64_t num_experts,
                      int64_t num_ranks, ffi::ResultBuffer<ffi::S32> clean_idx,
                      ffi::ResultBuffer<ffi::S32> num_invalid,
                      ffi::ResultBuffer<ffi::S32> first_invalid,
                      ffi::ResultBuffer<ffi::S32> tokens_per_rank,
                      ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                      ffi::ResultBuffer<ffi::PRED> is_token_in_rank) {
  auto dims = topk_idx.dimensions();
  if (dims.size() != 2) return Invalid("layout", "topk_idx must be 2-D, got " + Shape(dims));
  if (num_ranks <= 0 || num_experts <= 0 || num_experts % num_ranks != 0) {
    return Invalid("layout", "num_experts (" + std::to_string(num_experts) +
                                 ") must be a positive multiple of num_ranks (" +
                                 std::to_string(num_ranks) + ")");
  }
  const int64_t num_tokens = dims[0], num_topk = dims[1];
  if (clean_idx->element_count() != static_cast<size_t>(num_tokens * num_topk) ||
      first_invalid->element_count() != 3 ||
      tokens_per_rank->element_count() != static_cast<size_t>(num_ranks) ||
      tokens_per_expert->element_count() != static_cast<size_t>(num_experts) ||
      is_token_in_rank->element_count() != static_cast<size_t>(num_tokens * num_ranks)) {
    return Invalid("layout", "result shapes do not match topk_idx " + Shape(dims));
  }
  int64_t first = -1;
  num_invalid->typed_data()[0] =
      Layout(topk_idx.typed_data(), num_tokens, num_topk, num_experts, num_ranks,
             clean_idx->typed_data(), tokens_per_rank->typed_data(),
             tokens_per_expert->typed_data(), is_token_in_rank->typed_data(), &first);
  int32_t* info = first_invalid->typed_data();
  info[0] = first < 0 ? -1 : static_cast<int32_t>(first / num_topk);
  info[1] = first < 0 ? -1 : static_cast<int32_t>(first % num_topk);
  info[2] = first < 0 ? 0 : topk_idx.typed_data()[first];
  return ffi::Error::Success();
}

ffi::Error CheckInvalidImpl(ffi::Buffer<ffi::S32> clean_idx, ffi::Buffer<ffi::S32> invalid_counts,
                            ffi::Buffer<ffi::S32> first_invalid, int64_t num_experts,
                            ffi::ResultBuffer<ffi::S32> checked_idx) {
  const int64_t num_ranks = invalid_counts.element_count();
  if (first_invalid.element_count() != static_cast<size_t>(3 * num_ranks) ||
      checked_idx->element_count() != clean_idx.element_count()) {
    return Invalid("check_invalid", "expected counts [R], first_invalid [R, 3] and a result "
                                    "shaped like topk_idx");
  }
  std::copy_n(clean_idx.typed_data(), clean_idx.element_count(), checked_idx->typed_data());
  const int32_t* counts = invalid_counts.typed_data();
  const int32_t* first = first_invalid.typed_data();
  int64_t total = 0;
  std::string per_rank, detail;
  for (int64_t r = 0; r < num_ranks; ++r) {
    total += counts[r];
    per_rank += (r ? ", " : "") + std::to_string(counts[r]);
    if (counts[r] > 0 && detail.empty()) {
      detail = "first on rank " + std::to_string(r) + ": topk_idx[" +
               std::to_string(first[3 * r]) + "][" + std::to_string(first[3 * r + 1]) +
               "] = " + std::to_string(first[3 * r + 2]);
    }
  }
  if (total == 0) return ffi::Error::Success();
  return Invalid("debug_checks", std::to_string(total) + " top-k index(es) outside [-1, " +
                                     std::to_string(num_experts) + ") on the EP group " +
                                     "(per rank: [" + per_rank + "]); " + detail +
                                     ". EpConfig(debug_checks=True) makes these errors; "
                                     "without it they are treated as -1 and counted in "
                                     "num_invalid.");
}

namespace {

// ---------------------------------------------------------------- HT route
ffi::Error HtRouteImpl(ffi::Buffer<ffi::S32> clean_idx, ffi::Buffer<ffi::F32> weights,
                       ffi::Buffer<ffi::S32> row_offset, int64_t num_experts,
                       int64_t capacity, ffi::ResultBuffer<ffi::S32> send_idx,
                       ffi::ResultBuffer<ffi::F32> send_w, ffi::ResultBuffer<ffi::S32> send_slot,
                       ffi::ResultBuffer<ffi::S32> send_row) {
  auto dims = clean_idx.dimensions();
  if (dims.size() != 2 || weights.dimensions().size() != 2 ||
      weights.dimensions()[0] != dims[0] || weights.dimensions()[1] != dims[1]) {
    return Invalid("ht_route", "topk_idx " + Shape(dims) + " and topk_weights " +
                                   Shape(weights.dimensions()) + " must be the same [T, K]");
  }
  const int64_t num_tokens = dims[0], num_topk = dims[1];
  const int64_t num_ranks = row_offset.element_count();
  if (num_ranks <= 0 || num_experts % num_ranks != 0) {
    return Invalid("ht_route", "num_experts must be a multiple of the number of ranks");
  }
  const size_t exchanged = static_cast<size_t>(num_ranks * num_tokens * num_topk);
  if (send_idx->element_count() != exchanged || send_w->element_count() != exchanged ||
      send_slot->element_count() != static_cast<size_t>(num_tokens * num_ranks) ||
      send_row->element_count() != static_cast<size_t>(num_tokens * num_ranks)) {
    return Invalid("ht_route", "result shapes do not match [R, T, K] / [T, R]");
  }
  HtRoute(clean_idx.typed_data(), weights.typed_data(), num_tokens, num_topk, num_ranks,
          num_experts / num_ranks, capacity, row_offset.typed_data(), send_idx->typed_data(),
          send_w->typed_data(), send_slot->typed_data(), send_row->typed_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- HT compact
ffi::Error HtCompactImpl(ffi::Buffer<ffi::S32> recv_idx, ffi::Buffer<ffi::F32> recv_w,
                         int64_t experts_per_rank, ffi::ResultBuffer<ffi::S32> recv_src,
                         ffi::ResultBuffer<ffi::S32> out_idx, ffi::ResultBuffer<ffi::F32> out_w,
                         ffi::ResultBuffer<ffi::S32> tokens_per_expert,
                         ffi::ResultBuffer<ffi::S32> num_tokens,
                         ffi::ResultBuffer<ffi::S32> num_dropped) {
  auto dims = recv_idx.dimensions();
  if (dims.size() != 3 || recv_w.element_count() != recv_idx.element_count()) {
    return Invalid("ht_compact", "recv_idx must be [R, T, K] like recv_w, got " + Shape(dims));
  }
  const int64_t capacity = recv_src->element_count();
  if (out_idx->element_count() != static_cast<size_t>(capacity * dims[2]) ||
      out_w->element_count() != out_idx->element_count() ||
      tokens_per_expert->element_count() != static_cast<size_t>(experts_per_rank)) {
    return Invalid("ht_compact", "result shapes do not match capacity and K");
  }
  HtCompact(recv_idx.typed_data(), recv_w.typed_data(), dims[0], dims[1], dims[2],
            experts_per_rank, capacity, recv_src->typed_data(), out_idx->typed_data(),
            out_w->typed_data(), tokens_per_expert->typed_data(), num_tokens->typed_data(),
            num_dropped->typed_data());
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- LL route / compact
ffi::Error LlRouteImpl(ffi::Buffer<ffi::S32> clean_idx, int64_t num_experts,
                       ffi::ResultBuffer<ffi::S32> send_slot,
                       ffi::ResultBuffer<ffi::S32> send_mask) {
  auto dims = clean_idx.dimensions();
  if (dims.size() != 2) return Invalid("ll_route", "topk_idx must be 2-D, got " + Shape(dims));
  if (send_slot->element_count() != clean_idx.element_count() ||
      send_mask->element_count() != static_cast<size_t>(num_experts * dims[0])) {
    return Invalid("ll_route", "result shapes do not match [T, K] / [E, T]");
  }
  LlRoute(clean_idx.typed_data(), dims[0], dims[1], num_experts, send_slot->typed_data(),
          send_mask->typed_data());
  return ffi::Error::Success();
}

ffi::Error LlCompactImpl(ffi::Buffer<ffi::S32> recv_mask, ffi::ResultBuffer<ffi::S32> recv_src,
                         ffi::ResultBuffer<ffi::S32> count,
                         ffi::ResultBuffer<ffi::S32> gather_index) {
  auto dims = recv_mask.dimensions();
  if (dims.size() != 3) {
    return Invalid("ll_compact", "recv_mask must be [R, E_local, T], got " + Shape(dims));
  }
  auto src_dims = recv_src->dimensions();
  if (src_dims.size() != 2 || src_dims[0] != dims[1] ||
      gather_index->element_count() != recv_src->element_count() ||
      count->element_count() != static_cast<size_t>(dims[1])) {
    return Invalid("ll_compact", "results must be [E_local, rows] and [E_local]");
  }
  LlCompact(recv_mask.typed_data(), dims[0], dims[1], dims[2], src_dims[1],
            recv_src->typed_data(), count->typed_data(), gather_index->typed_data());
  return ffi::Error::Success();
}

}  // namespace

// ---------------------------------------------------------------- row movement
ffi::Error ScatterRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                           ffi::Result<ffi::AnyBuffer> out) {
  auto src_dims = src.dimensions();
  auto index_dims = index.dimensions();
  auto out_dims = out->dimensions();
  if (src_dims.size() == 0 || out_dims.size() == 0 || index_dims.size() != 2 ||
      index_dims[0] != src_dims[0] || !SameTrailing(src_dims, out_dims) ||
      src.element_type() != out->element_type()) {
    return Invalid("scatter_rows", "src " + Shape(src_dims) + ", index " + Shape(index_dims) +
                                       " and out " + Shape(out_dims) +
                                       " must be [N, ...], [N, M], [P, ...] of one dtype");
  }
  const int64_t row_bytes = TrailingCount(src_dims) * ffi::ByteWidth(src.element_type());
  ScatterRows(src.untyped_data(), src_dims[0], row_bytes, index.typed_data(), index_dims[1],
              out->untyped_data(), out_dims[0]);
  return ffi::Error::Success();
}

ffi::Error GatherRowsImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                          ffi::Result<ffi::AnyBuffer> out) {
  auto src_dims = src.dimensions();
  auto out_dims = out->dimensions();
  if (src_dims.size() == 0 || out_dims.size() == 0 || !SameTrailing(src_dims, out_dims) ||
      index.element_count() != static_cast<size_t>(out_dims[0]) ||
      src.element_type() != out->element_type()) {
    return Invalid("gather_rows", "src " + Shape(src_dims) + ", index " +
                                      Shape(index.dimensions()) + " and out " + Shape(out_dims) +
                                      " must be [P, ...], [N], [N, ...] of one dtype");
  }
  const int64_t row_bytes = TrailingCount(src_dims) * ffi::ByteWidth(src.element_type());
  GatherRows(src.untyped_data(), src_dims[0], row_bytes, index.typed_data(), out_dims[0],
             out->untyped_data());
  return ffi::Error::Success();
}

ffi::Error GatherReduceImpl(ffi::AnyBuffer src, ffi::Buffer<ffi::S32> index,
                            ffi::Buffer<ffi::F32> weights, ffi::Result<ffi::AnyBuffer> out) {
  auto src_dims = src.dimensions();
  auto index_dims = index.dimensions();
  auto out_dims = out->dimensions();
  if (src_dims.size() == 0 || index_dims.size() != 2 || out_dims.size() == 0 ||
      index_dims[0] != out_dims[0] || !SameTrailing(src_dims, out_dims) ||
      weights.element_count() != index.element_count() ||
      src.element_type() != out->element_type()) {
    return Invalid("gather_reduce", "src " + Shape(src_dims) + ", index " + Shape(index_dims) +
                                        ", weights and out " + Shape(out_dims) +
                                        " must be [P, ...], [N, M], [N, M], [N, ...]");
  }
  FloatKind kind;
  switch (src.element_type()) {
    case ffi::DataType::F32: kind = FloatKind::kF32; break;
    case ffi::DataType::BF16: kind = FloatKind::kBF16; break;
    case ffi::DataType::F16: kind = FloatKind::kF16; break;
    default:
      return Invalid("gather_reduce", "rows must be float32, bfloat16 or float16");
  }
  GatherReduce(kind, src.untyped_data(), src_dims[0], TrailingCount(src_dims),
               index.typed_data(), weights.typed_data(), out_dims[0], index_dims[1],
               out->untyped_data());
  return ffi::Error::Success();
}

namespace {

XLA_FFI_DEFINE_HANDLER(kLayout, LayoutImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("num_ranks")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER(kCheckInvalid, CheckInvalidImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER(kHtRoute, HtRouteImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Attr<int64_t>("capacity")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER(kHtCompact, HtCompactImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Attr<int64_t>("experts_per_rank")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER(kLlRoute, LlRouteImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Attr<int64_t>("num_experts")
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER(kLlCompact, LlCompactImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER(kScatterRows, ScatterRowsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER(kGatherRows, GatherRowsImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER(kGatherReduce, GatherReduceImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .Arg<ffi::Buffer<ffi::F32>>()
                           .Ret<ffi::AnyBuffer>());

const HandlerEntry kHandlers[] = {
    {exports::kCpuLayout, kLayout},
    {exports::kCpuCheckInvalid, kCheckInvalid},
    {exports::kCpuHtRoute, kHtRoute},
    {exports::kCpuHtCompact, kHtCompact},
    {exports::kCpuLlRoute, kLlRoute},
    {exports::kCpuLlCompact, kLlCompact},
    {exports::kCpuScatterRows, kScatterRows},
    {exports::kCpuGatherRows, kGatherRows},
    {exports::kCpuGatherReduce, kGatherReduce},
    {nullptr, nullptr},
};

}  // namespace

const HandlerEntry* CpuHandlers() { return kHandlers; }

}  // namespace jax_ep::cpu
