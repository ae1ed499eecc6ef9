// Unit tests of the CPU FFI handler implementations (xla_ffi/cpu/cpu_handlers.h),
// called directly with hand-built XLA_FFI_Buffer structs: argument decoding,
// shape validation (InvalidArgument), and the debug_checks error message.
#include "xla_ffi/cpu/cpu_handlers.h"

#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "tests/cc/check.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = ::xla::ffi;
using I32 = std::vector<int32_t>;
using F32 = std::vector<float>;
using U16 = std::vector<uint16_t>;
using Dims = std::vector<int64_t>;

// A host array viewed as an XLA_FFI_Buffer (what XLA passes to a CPU handler).
// Not copyable or movable: buf_ points into dims_ and storage_.
class HostBuffer {
 public:
  HostBuffer(ffi::DataType dtype, Dims dims) : dims_(std::move(dims)) {
    size_t count = 1;
    for (int64_t d : dims_) count *= static_cast<size_t>(d);
    bytes_ = count * ffi::ByteWidth(dtype);
    storage_.assign((bytes_ + 7) / 8 + 1, 0xa5a5a5a5a5a5a5a5ull);  // garbage: must be overwritten
    buf_.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    buf_.extension_start = nullptr;
    buf_.dtype = static_cast<XLA_FFI_DataType>(dtype);
    buf_.data = storage_.data();
    buf_.rank = static_cast<int64_t>(dims_.size());
    buf_.dims = dims_.data();
  }

  template <typename T>
  HostBuffer(ffi::DataType dtype, Dims dims, const std::vector<T>& values)
      : HostBuffer(dtype, std::move(dims)) {
    CHECK_EQ(values.size() * sizeof(T), bytes_) << "test bug: values do not fill the buffer";
    std::memcpy(storage_.data(), values.data(), std::min(bytes_, values.size() * sizeof(T)));
  }

  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  ffi::AnyBuffer Any() const { return ffi::AnyBuffer(&buf_); }

  template <ffi::DataType dtype>
  ffi::Buffer<dtype> Typed() const {
    CHECK_EQ(static_cast<int>(buf_.dtype), static_cast<int>(dtype)) << "test bug: dtype";
    return ffi::Buffer<dtype>(&buf_);
  }

  // Results: ffi::Result<T> is constructible from T.
  ffi::Result<ffi::AnyBuffer> AnyResult() const { return ffi::Result<ffi::AnyBuffer>(Any()); }

  template <ffi::DataType dtype>
  ffi::ResultBuffer<dtype> TypedResult() const {
    return ffi::ResultBuffer<dtype>(Typed<dtype>());
  }

  template <typename T>
  std::vector<T> Values() const {
    std::vector<T> values(bytes_ / sizeof(T));
    std::memcpy(values.data(), storage_.data(), values.size() * sizeof(T));
    return values;
  }

 private:
  Dims dims_;
  size_t bytes_ = 0;
  std::vector<uint64_t> storage_;
  XLA_FFI_Buffer buf_;
};

bool IsInvalidArgument(const ffi::Error& error) {
  return error.failure() && error.errc() == ffi::ErrorCode::kInvalidArgument;
}

std::vector<bool> Bools(const HostBuffer& buffer) {
  std::vector<bool> out;
  for (uint8_t b : buffer.Values<uint8_t>()) out.push_back(b != 0);
  return out;
}

// ============================================================================
// LayoutImpl
// ============================================================================

struct LayoutBuffers {
  HostBuffer clean, num_invalid, first_invalid, per_rank, per_expert, in_rank;
  LayoutBuffers(int64_t tokens, int64_t k, int64_t experts, int64_t ranks,
                int64_t first_invalid_size = 3)
      : clean(ffi::DataType::S32, {tokens, k}),
        num_invalid(ffi::DataType::S32, {}),
        first_invalid(ffi::DataType::S32, {first_invalid_size}),
        per_rank(ffi::DataType::S32, {ranks}),
        per_expert(ffi::DataType::S32, {experts}),
        in_rank(ffi::DataType::PRED, {tokens, ranks}) {}

  ffi::Error Run(const HostBuffer& topk, int64_t experts, int64_t ranks) {
    return jax_ep::cpu::LayoutImpl(
        topk.Typed<ffi::DataType::S32>(), experts, ranks,
        clean.TypedResult<ffi::DataType::S32>(), num_invalid.TypedResult<ffi::DataType::S32>(),
        first_invalid.TypedResult<ffi::DataType::S32>(),
        per_rank.TypedResult<ffi::DataType::S32>(), per_expert.TypedResult<ffi::DataType::S32>(),
        in_rank.TypedResult<ffi::DataType::PRED>());
  }
};

TEST(LayoutImpl, ComputesLayoutAndReportsFirstInvalid) {
  // T = 3, K = 2, E = 4, R = 2; topk_idx[1][1] = 9 and topk_idx[2][0] = -5 are invalid.
  HostBuffer topk(ffi::DataType::S32, {3, 2}, I32{0, 3, 1, 9, -5, 2});
  LayoutBuffers out(3, 2, 4, 2);
  ffi::Error error = out.Run(topk, 4, 2);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.clean.Values<int32_t>(), (I32{0, 3, 1, -1, -1, 2}));
  CHECK_EQ(out.num_invalid.Values<int32_t>(), (I32{2}));
  CHECK_EQ(out.first_invalid.Values<int32_t>(), (I32{1, 1, 9}));  // (token, slot, value)
  CHECK_EQ(out.per_rank.Values<int32_t>(), (I32{2, 2}));
  CHECK_EQ(out.per_expert.Values<int32_t>(), (I32{1, 1, 1, 1}));
  CHECK_EQ(Bools(out.in_rank), (std::vector<bool>{true, true, true, false, false, true}));
}

TEST(LayoutImpl, NoInvalidIndices) {
  HostBuffer topk(ffi::DataType::S32, {2, 2}, I32{-1, 0, 1, 1});
  LayoutBuffers out(2, 2, 2, 1);
  ffi::Error error = out.Run(topk, 2, 1);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.num_invalid.Values<int32_t>(), (I32{0}));
  CHECK_EQ(out.first_invalid.Values<int32_t>(), (I32{-1, -1, 0}));
  CHECK_EQ(out.per_expert.Values<int32_t>(), (I32{1, 1}));
  CHECK_EQ(out.per_rank.Values<int32_t>(), (I32{2}));
}

TEST(LayoutImpl, RejectsNon2DTopk) {
  HostBuffer topk(ffi::DataType::S32, {2, 2, 1}, I32{0, 1, 2, 3});
  LayoutBuffers out(2, 2, 4, 2);
  ffi::Error error = out.Run(topk, 4, 2);
  CHECK(IsInvalidArgument(error)) << error.message();
  CHECK_CONTAINS(error.message(), "topk_idx must be 2-D");
  CHECK_CONTAINS(error.message(), "[2, 2, 1]");
}

TEST(LayoutImpl, RejectsExpertsNotMultipleOfRanks) {
  HostBuffer topk(ffi::DataType::S32, {1, 1}, I32{0});
  {
    LayoutBuffers out(1, 1, 5, 2);
    ffi::Error error = out.Run(topk, 5, 2);
    CHECK(IsInvalidArgument(error)) << error.message();
    CHECK_CONTAINS(error.message(), "num_experts (5)");
    CHECK_CONTAINS(error.message(), "num_ranks (2)");
  }
  {
    LayoutBuffers out(1, 1, 4, 1);
    ffi::Error error = out.Run(topk, 4, 0);
    CHECK(IsInvalidArgument(error)) << error.message();
  }
  {
    LayoutBuffers out(1, 1, 1, 1);
    ffi::Error error = out.Run(topk, 0, 1);
    CHECK(IsInvalidArgument(error)) << error.message();
  }
}

TEST(LayoutImpl, RejectsMismatchedResultShapes) {
  HostBuffer topk(ffi::DataType::S32, {3, 2}, I32{0, 1, 2, 3, 0, 1});
  {
    LayoutBuffers out(3, 2, /*experts=*/8, 2);  // tokens_per_expert [8] for E = 4
    ffi::Error error = out.Run(topk, 4, 2);
    CHECK(IsInvalidArgument(error)) << error.message();
    CHECK_CONTAINS(error.message(), "result shapes do not match topk_idx [3, 2]");
  }
  {
    LayoutBuffers out(3, 2, 4, 2, /*first_invalid_size=*/2);
    ffi::Error error = out.Run(topk, 4, 2);
    CHECK(IsInvalidArgument(error)) << error.message();
  }
  {
    LayoutBuffers out(2, 2, 4, 2);  // clean_idx [2, 2] for [3, 2]
    ffi::Error error = out.Run(topk, 4, 2);
    CHECK(IsInvalidArgument(error)) << error.message();
  }
  {
    LayoutBuffers out(3, 2, 4, 4);  // tokens_per_rank [4] for R = 2
    ffi::Error error = out.Run(topk, 4, 2);
    CHECK(IsInvalidArgument(error)) << error.message();
  }
}

// ============================================================================
// CheckInvalidImpl (EpConfig(debug_checks=True))
// ============================================================================

TEST(CheckInvalidImpl, PassesCleanIndicesThroughWhenAllValid) {
  HostBuffer clean(ffi::DataType::S32, {2, 2}, I32{0, -1, 7, 3});
  HostBuffer counts(ffi::DataType::S32, {2}, I32{0, 0});
  HostBuffer first(ffi::DataType::S32, {2, 3}, I32{-1, -1, 0, -1, -1, 0});
  HostBuffer checked(ffi::DataType::S32, {2, 2});
  ffi::Error error = jax_ep::cpu::CheckInvalidImpl(
      clean.Typed<ffi::DataType::S32>(), counts.Typed<ffi::DataType::S32>(),
      first.Typed<ffi::DataType::S32>(), 8, checked.TypedResult<ffi::DataType::S32>());
  CHECK(error.success()) << error.message();
  CHECK_EQ(checked.Values<int32_t>(), (I32{0, -1, 7, 3}));
}

TEST(CheckInvalidImpl, ErrorNamesTheFirstBadIndex) {
  HostBuffer clean(ffi::DataType::S32, {4, 2}, I32(8, 0));
  HostBuffer counts(ffi::DataType::S32, {3}, I32{0, 2, 1});
  HostBuffer first(ffi::DataType::S32, {3, 3}, I32{-1, -1, 0, 3, 1, 9, 0, 0, -4});
  HostBuffer checked(ffi::DataType::S32, {4, 2});
  ffi::Error error = jax_ep::cpu::CheckInvalidImpl(
      clean.Typed<ffi::DataType::S32>(), counts.Typed<ffi::DataType::S32>(),
      first.Typed<ffi::DataType::S32>(), 8, checked.TypedResult<ffi::DataType::S32>());
  CHECK(IsInvalidArgument(error)) << error.message();
  CHECK_CONTAINS(error.message(), "3 top-k index(es) outside [-1, 8)");
  CHECK_CONTAINS(error.message(), "per rank: [0, 2, 1]");
  CHECK_CONTAINS(error.message(), "first on rank 1: topk_idx[3][1] = 9");
  CHECK_CONTAINS(error.message(), "debug_checks");
  CHECK(error.message().find("= -4") == std::string::npos)
      << "only the first bad index is named: " << error.message();
}

TEST(CheckInvalidImpl, RejectsBadShapes) {
  HostBuffer clean(ffi::DataType::S32, {2, 2}, I32{0, 1, 2, 3});
  HostBuffer counts(ffi::DataType::S32, {2}, I32{0, 0});
  HostBuffer first_bad(ffi::DataType::S32, {2, 2}, I32{-1, -1, -1, -1});  // [R, 2], not [R, 3]
  HostBuffer first(ffi::DataType::S32, {2, 3}, I32{-1, -1, 0, -1, -1, 0});
  HostBuffer checked(ffi::DataType::S32, {2, 2});
  HostBuffer checked_bad(ffi::DataType::S32, {3});
  ffi::Error error = jax_ep::cpu::CheckInvalidImpl(
      clean.Typed<ffi::DataType::S32>(), counts.Typed<ffi::DataType::S32>(),
      first_bad.Typed<ffi::DataType::S32>(), 8, checked.TypedResult<ffi::DataType::S32>());
  CHECK(IsInvalidArgument(error)) << error.message();
  CHECK_CONTAINS(error.message(), "check_invalid");
  error = jax_ep::cpu::CheckInvalidImpl(
      clean.Typed<ffi::DataType::S32>(), counts.Typed<ffi::DataType::S32>(),
      first.Typed<ffi::DataType::S32>(), 8, checked_bad.TypedResult<ffi::DataType::S32>());
  CHECK(IsInvalidArgument(error)) << error.message();
}

// ============================================================================
// ScatterRowsImpl
// ============================================================================

ffi::Error ScatterRows(const HostBuffer& src, const HostBuffer& index, const HostBuffer& out) {
  return jax_ep::cpu::ScatterRowsImpl(src.Any(), index.Typed<ffi::DataType::S32>(),
                                      out.AnyResult());
}

TEST(ScatterRowsImpl, F32Rows) {
  HostBuffer src(ffi::DataType::F32, {3, 2}, F32{1, 2, 3, 4, 5, 6});
  HostBuffer index(ffi::DataType::S32, {3, 2}, I32{2, -1, 0, 3, 9, -1});
  HostBuffer out(ffi::DataType::F32, {4, 2});
  ffi::Error error = ScatterRows(src, index, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<float>(), (F32{3, 4, 0, 0, 1, 2, 3, 4}));
}

TEST(ScatterRowsImpl, Bf16RowsWithTrailingDims) {
  // src [2, 2, 3] bf16 (rows of 12 bytes), out [3, 2, 3].
  const U16 values = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  HostBuffer src(ffi::DataType::BF16, {2, 2, 3}, values);
  HostBuffer index(ffi::DataType::S32, {2, 1}, I32{2, 0});
  HostBuffer out(ffi::DataType::BF16, {3, 2, 3});
  ffi::Error error = ScatterRows(src, index, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<uint16_t>(),
           (U16{7, 8, 9, 10, 11, 12, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6}));
}

TEST(ScatterRowsImpl, RejectsBadShapesAndDtypes) {
  HostBuffer src(ffi::DataType::F32, {3, 2}, F32(6, 1.0f));
  HostBuffer index(ffi::DataType::S32, {3, 1}, I32{0, 1, 2});
  HostBuffer index_rows(ffi::DataType::S32, {2, 1}, I32{0, 1});  // N mismatch
  HostBuffer index_1d(ffi::DataType::S32, {3}, I32{0, 1, 2});
  HostBuffer out(ffi::DataType::F32, {4, 2});
  HostBuffer out_width(ffi::DataType::F32, {4, 3});
  HostBuffer out_rank(ffi::DataType::F32, {4, 2, 1});
  HostBuffer out_dtype(ffi::DataType::S32, {4, 2});
  HostBuffer scalar(ffi::DataType::F32, {}, F32{1.0f});

  CHECK(ScatterRows(src, index, out).success());
  for (const auto& [what, error] : std::vector<std::pair<std::string, ffi::Error>>{
           {"index rows", ScatterRows(src, index_rows, out)},
           {"index rank", ScatterRows(src, index_1d, out)},
           {"out width", ScatterRows(src, index, out_width)},
           {"out rank", ScatterRows(src, index, out_rank)},
           {"out dtype", ScatterRows(src, index, out_dtype)},
           {"scalar src", ScatterRows(scalar, index, out)},
       }) {
    CHECK(IsInvalidArgument(error)) << what << ": " << error.message();
    CHECK_CONTAINS(error.message(), "jax_ep scatter_rows");
  }
  ffi::Error error = ScatterRows(src, index_rows, out);
  CHECK_CONTAINS(error.message(), "src [3, 2], index [2, 1] and out [4, 2]");
}

// ============================================================================
// GatherRowsImpl
// ============================================================================

ffi::Error GatherRows(const HostBuffer& src, const HostBuffer& index, const HostBuffer& out) {
  return jax_ep::cpu::GatherRowsImpl(src.Any(), index.Typed<ffi::DataType::S32>(),
                                     out.AnyResult());
}

TEST(GatherRowsImpl, GathersRowsZeroingInvalid) {
  HostBuffer src(ffi::DataType::S32, {3, 2}, I32{1, 2, 3, 4, 5, 6});
  HostBuffer index(ffi::DataType::S32, {4}, I32{2, -1, 0, 3});
  HostBuffer out(ffi::DataType::S32, {4, 2});
  ffi::Error error = GatherRows(src, index, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<int32_t>(), (I32{5, 6, 0, 0, 1, 2, 0, 0}));
}

TEST(GatherRowsImpl, F16RowsWithTrailingDims) {
  HostBuffer src(ffi::DataType::F16, {2, 1, 2}, U16{0x3C00, 0x4000, 0x4200, 0x4400});
  HostBuffer index(ffi::DataType::S32, {3}, I32{1, 1, 0});
  HostBuffer out(ffi::DataType::F16, {3, 1, 2});
  ffi::Error error = GatherRows(src, index, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<uint16_t>(), (U16{0x4200, 0x4400, 0x4200, 0x4400, 0x3C00, 0x4000}));
}

TEST(GatherRowsImpl, RejectsBadShapesAndDtypes) {
  HostBuffer src(ffi::DataType::F32, {3, 2}, F32(6, 1.0f));
  HostBuffer index(ffi::DataType::S32, {4}, I32{0, 1, 2, 0});
  HostBuffer index_short(ffi::DataType::S32, {3}, I32{0, 1, 2});
  HostBuffer out(ffi::DataType::F32, {4, 2});
  HostBuffer out_width(ffi::DataType::F32, {4, 1});
  HostBuffer out_dtype(ffi::DataType::BF16, {4, 2});
  HostBuffer scalar_out(ffi::DataType::F32, {});

  CHECK(GatherRows(src, index, out).success());
  for (const auto& [what, error] : std::vector<std::pair<std::string, ffi::Error>>{
           {"index length", GatherRows(src, index_short, out)},
           {"out width", GatherRows(src, index, out_width)},
           {"out dtype", GatherRows(src, index, out_dtype)},
           {"scalar out", GatherRows(src, index, scalar_out)},
       }) {
    CHECK(IsInvalidArgument(error)) << what << ": " << error.message();
    CHECK_CONTAINS(error.message(), "jax_ep gather_rows");
  }
}

// ============================================================================
// GatherReduceImpl
// ============================================================================

ffi::Error GatherReduce(const HostBuffer& src, const HostBuffer& index, const HostBuffer& w,
                        const HostBuffer& out) {
  return jax_ep::cpu::GatherReduceImpl(src.Any(), index.Typed<ffi::DataType::S32>(),
                                       w.Typed<ffi::DataType::F32>(), out.AnyResult());
}

TEST(GatherReduceImpl, F32) {
  HostBuffer src(ffi::DataType::F32, {3, 2}, F32{1, 2, 10, 20, 100, 200});
  HostBuffer index(ffi::DataType::S32, {2, 2}, I32{0, 2, 1, -1});
  HostBuffer w(ffi::DataType::F32, {2, 2}, F32{0.5f, 0.25f, 3.0f, 100.0f});
  HostBuffer out(ffi::DataType::F32, {2, 2});
  ffi::Error error = GatherReduce(src, index, w, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<float>(), (F32{25.5f, 51.0f, 30.0f, 60.0f}));
}

TEST(GatherReduceImpl, Bf16RoundsToNearestEven) {
  // rows: [1.0], [2^-8]; 1 + 2^-8 is a tie -> 1.0; 1 + 3 * 2^-8 -> 0x3F82.
  HostBuffer src(ffi::DataType::BF16, {2, 1}, U16{0x3F80, 0x3B80});
  HostBuffer index(ffi::DataType::S32, {2, 2}, I32{0, 1, 0, 1});
  HostBuffer w(ffi::DataType::F32, {2, 2}, F32{1.0f, 1.0f, 1.0f, 3.0f});
  HostBuffer out(ffi::DataType::BF16, {2, 1});
  ffi::Error error = GatherReduce(src, index, w, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<uint16_t>(), (U16{0x3F80, 0x3F82}));
}

TEST(GatherReduceImpl, F16RoundsToNearestEven) {
  // rows: [1.0], [2^-11] (0x1000 = 2^-11); ties to even as above.
  HostBuffer src(ffi::DataType::F16, {2, 1}, U16{0x3C00, 0x1000});
  HostBuffer index(ffi::DataType::S32, {3, 2}, I32{0, 1, 0, 1, 1, -1});
  HostBuffer w(ffi::DataType::F32, {3, 2}, F32{1.0f, 1.0f, 1.0f, 3.0f, 0.5f, 1.0f});
  HostBuffer out(ffi::DataType::F16, {3, 1});
  ffi::Error error = GatherReduce(src, index, w, out);
  CHECK(error.success()) << error.message();
  CHECK_EQ(out.Values<uint16_t>(), (U16{0x3C00, 0x3C02, 0x0C00}));  // 0x0C00 = 2^-12
}

TEST(GatherReduceImpl, RejectsUnsupportedDtypeAndBadShapes) {
  HostBuffer src_i32(ffi::DataType::S32, {2, 1}, I32{1, 2});
  HostBuffer out_i32(ffi::DataType::S32, {1, 1});
  HostBuffer src(ffi::DataType::BF16, {2, 1}, U16{0x3F80, 0x3F80});
  HostBuffer out(ffi::DataType::BF16, {1, 1});
  HostBuffer out_f16(ffi::DataType::F16, {1, 1});
  HostBuffer out_rows(ffi::DataType::BF16, {2, 1});
  HostBuffer out_width(ffi::DataType::BF16, {1, 2});
  HostBuffer index(ffi::DataType::S32, {1, 2}, I32{0, 1});
  HostBuffer index_1d(ffi::DataType::S32, {2}, I32{0, 1});
  HostBuffer w(ffi::DataType::F32, {1, 2}, F32{1, 1});
  HostBuffer w_short(ffi::DataType::F32, {1, 1}, F32{1});

  CHECK(GatherReduce(src, index, w, out).success());

  ffi::Error error = GatherReduce(src_i32, index, w, out_i32);
  CHECK(IsInvalidArgument(error)) << error.message();
  CHECK_CONTAINS(error.message(), "rows must be float32, bfloat16 or float16");

  for (const auto& [what, err] : std::vector<std::pair<std::string, ffi::Error>>{
           {"weights count", GatherReduce(src, index, w_short, out)},
           {"out rows", GatherReduce(src, index, w, out_rows)},
           {"out width", GatherReduce(src, index, w, out_width)},
           {"out dtype", GatherReduce(src, index, w, out_f16)},
           {"index rank", GatherReduce(src, index_1d, w, out)},
       }) {
    CHECK(IsInvalidArgument(err)) << what << ": " << err.message();
    CHECK_CONTAINS(err.message(), "jax_ep gather_reduce");
  }
}

// ============================================================================
// Registration table
// ============================================================================

TEST(CpuHandlers, TableIsNullTerminatedWithUniqueNames) {
  std::set<std::string> names;
  const jax_ep::cpu::HandlerEntry* entry = jax_ep::cpu::CpuHandlers();
  CHECK(entry != nullptr);
  int count = 0;
  for (; entry != nullptr && entry->name != nullptr && count < 1000; ++entry, ++count) {
    CHECK(entry->handler != nullptr) << entry->name;
    CHECK(std::string(entry->name).rfind("jax_ep_cpu_", 0) == 0) << entry->name;
    CHECK(names.insert(entry->name).second) << "duplicate " << entry->name;
  }
  CHECK_LT(count, 1000) << "no terminating entry";
  for (const char* expected :
       {"jax_ep_cpu_layout", "jax_ep_cpu_check_invalid", "jax_ep_cpu_ht_route",
        "jax_ep_cpu_ht_compact", "jax_ep_cpu_ll_route", "jax_ep_cpu_ll_compact",
        "jax_ep_cpu_scatter_rows", "jax_ep_cpu_gather_rows", "jax_ep_cpu_gather_reduce"}) {
    CHECK(names.count(expected)) << "missing " << expected;
  }
}

}  // namespace

int main(int argc, char** argv) { return jax_ep_test::RunAllTests("cpu_handlers_test", argc, argv); }
