// Unit tests of xla_ffi/cpu/portable_ops.h: the plain C++ local steps of the
// portable backend (no XLA involved).
#include "xla_ffi/cpu/portable_ops.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "tests/cc/check.h"

namespace {

using jax_ep::cpu::FloatKind;
using I32 = std::vector<int32_t>;
using F32 = std::vector<float>;

constexpr int32_t kGarbage = 0x5a5a5a5a;  // pre-fill of outputs: every element must be written

// ----------------------------------------------------------------------------
// Bit helpers for the reduced-precision element types.

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

float BitsToFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// bf16 bits of a float that bf16 represents exactly.
uint16_t ExactBf16(float value) {
  const uint32_t bits = FloatBits(value);
  return static_cast<uint16_t>(bits >> 16);
}

// GatherReduce of a single source row [value] with weight w: rounds
// value * w (computed in fp32) to the element type.
uint16_t ReduceOne16(FloatKind kind, uint16_t value_bits, float weight) {
  const uint16_t src[1] = {value_bits};
  const int32_t index[1] = {0};
  const float weights[1] = {weight};
  uint16_t out[1] = {0xdead};
  jax_ep::cpu::GatherReduce(kind, src, 1, 1, index, weights, 1, 1, out);
  return out[0];
}

// ============================================================================
// Layout
// ============================================================================

struct LayoutOut {
  I32 clean, per_rank, per_expert;
  std::vector<bool> in_rank;
  int32_t num_invalid;
  int64_t first_invalid;
};

LayoutOut RunLayout(const I32& topk, int64_t tokens, int64_t topk_k, int64_t experts,
                    int64_t ranks) {
  LayoutOut out;
  out.clean.assign(topk.size(), kGarbage);
  out.per_rank.assign(ranks, kGarbage);
  out.per_expert.assign(experts, kGarbage);
  std::unique_ptr<bool[]> in_rank(new bool[tokens * ranks]);
  std::memset(in_rank.get(), 1, tokens * ranks);
  out.first_invalid = 12345;
  out.num_invalid = jax_ep::cpu::Layout(topk.data(), tokens, topk_k, experts, ranks,
                                        out.clean.data(), out.per_rank.data(),
                                        out.per_expert.data(), in_rank.get(), &out.first_invalid);
  out.in_rank.assign(in_rank.get(), in_rank.get() + tokens * ranks);
  return out;
}

TEST(Layout, CountsTokensPerRankAndExpert) {
  // E = 8, R = 2 (4 experts per rank), T = 4, K = 2.
  const I32 topk = {
      0, 5,    // token 0: rank 0 and rank 1
      1, 2,    // token 1: rank 0 twice -> counted once for the rank
      7, -1,   // token 2: rank 1 only; -1 is "no expert", not invalid
      -1, -1,  // token 3: nowhere
  };
  LayoutOut out = RunLayout(topk, 4, 2, 8, 2);
  CHECK_EQ(out.num_invalid, 0);
  CHECK_EQ(out.first_invalid, -1);
  CHECK_EQ(out.clean, topk);
  CHECK_EQ(out.per_rank, (I32{2, 2}));
  CHECK_EQ(out.per_expert, (I32{1, 1, 1, 0, 0, 1, 0, 1}));
  CHECK_EQ(out.in_rank, (std::vector<bool>{true, true, true, false, false, true, false, false}));
}

TEST(Layout, InvalidIndicesBecomeMinusOneAndAreCounted) {
  // E = 4, R = 2. Valid range is [-1, 4).
  const I32 topk = {
      1, 4,     // 4 == E: invalid (flat position 1, the first)
      -2, 3,    // -2 < -1: invalid
      2, 1000,  // invalid
      -1, 0,
  };
  LayoutOut out = RunLayout(topk, 4, 2, 4, 2);
  CHECK_EQ(out.num_invalid, 3);
  CHECK_EQ(out.first_invalid, 1);
  CHECK_EQ(out.clean, (I32{1, -1, -1, 3, 2, -1, -1, 0}));
  CHECK_EQ(out.per_expert, (I32{1, 1, 1, 1}));
  CHECK_EQ(out.per_rank, (I32{2, 2}));
  CHECK_EQ(out.in_rank,
           (std::vector<bool>{true, false, false, true, false, true, true, false}));
}

TEST(Layout, FirstInvalidIsTheFirstFlatPosition) {
  const I32 topk = {0, 1, 2, 3, 0, 1, -7, 99};
  LayoutOut out = RunLayout(topk, 4, 2, 4, 1);
  CHECK_EQ(out.num_invalid, 2);
  CHECK_EQ(out.first_invalid, 6);
  CHECK_EQ(out.clean, (I32{0, 1, 2, 3, 0, 1, -1, -1}));
  CHECK_EQ(out.per_rank, (I32{3}));
}

TEST(Layout, DuplicateExpertCountedOncePerToken) {
  // E = 4, R = 2: token 0 picks expert 2 three times, token 1 expert 1 twice.
  const I32 topk = {2, 2, 2, 1, -1, 1};
  LayoutOut out = RunLayout(topk, 2, 3, 4, 2);
  CHECK_EQ(out.num_invalid, 0);
  CHECK_EQ(out.clean, topk);  // duplicates are kept in clean_idx
  CHECK_EQ(out.per_expert, (I32{0, 1, 1, 0}));
  CHECK_EQ(out.per_rank, (I32{1, 1}));
  CHECK_EQ(out.in_rank, (std::vector<bool>{false, true, true, false}));
}

TEST(Layout, SingleRankAndEmptyInput) {
  LayoutOut one = RunLayout({3, 0, 3, 3}, 2, 2, 4, 1);
  CHECK_EQ(one.per_rank, (I32{2}));
  CHECK_EQ(one.per_expert, (I32{1, 0, 0, 2}));
  CHECK_EQ(one.in_rank, (std::vector<bool>{true, true}));

  LayoutOut empty = RunLayout({}, 0, 2, 4, 2);
  CHECK_EQ(empty.num_invalid, 0);
  CHECK_EQ(empty.first_invalid, -1);
  CHECK_EQ(empty.per_rank, (I32{0, 0}));
  CHECK_EQ(empty.per_expert, (I32{0, 0, 0, 0}));
}

TEST(Layout, ExpertsPerRankMapping) {
  // E = 12, R = 4 -> 3 experts per rank; expert e lives on rank e / 3.
  const I32 topk = {0, 2, 3, 5, 6, 11, 9, 8};
  LayoutOut out = RunLayout(topk, 1, 8, 12, 4);
  CHECK_EQ(out.per_rank, (I32{1, 1, 1, 1}));
  CHECK_EQ(out.per_expert, (I32{1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1}));
  CHECK_EQ(out.in_rank, (std::vector<bool>{true, true, true, true}));
}

// ============================================================================
// HT route (sender side)
// ============================================================================

struct HtRouteOut {
  I32 send_idx;
  F32 send_w;
  I32 send_slot, send_row;
};

HtRouteOut RunHtRoute(const I32& idx, const F32& w, int64_t tokens, int64_t k, int64_t ranks,
                      int64_t experts_per_rank, int64_t capacity, const I32& row_offset) {
  HtRouteOut out;
  out.send_idx.assign(ranks * tokens * k, kGarbage);
  out.send_w.assign(ranks * tokens * k, -99.0f);
  out.send_slot.assign(tokens * ranks, kGarbage);
  out.send_row.assign(tokens * ranks, kGarbage);
  jax_ep::cpu::HtRoute(idx.data(), w.data(), tokens, k, ranks, experts_per_rank, capacity,
                       row_offset.data(), out.send_idx.data(), out.send_w.data(),
                       out.send_slot.data(), out.send_row.data());
  return out;
}

TEST(HtRoute, SplitsTokensByDestinationRank) {
  // T = 3, K = 2, R = 2, 2 experts per rank (E = 4); plenty of capacity.
  const I32 idx = {0, 3,    // token 0 -> rank 0 (local 0) and rank 1 (local 1)
                   1, 1,    // token 1 -> rank 0 (local 1, twice)
                   -1, 2};  // token 2 -> rank 1 (local 0)
  const F32 w = {0.5f, 0.25f, 0.125f, 2.0f, 7.0f, 3.0f};
  HtRouteOut out = RunHtRoute(idx, w, 3, 2, 2, 2, 100, {0, 10});
  // [R, T, K]
  CHECK_EQ(out.send_idx, (I32{0, -1, 1, 1, -1, -1,    // to rank 0
                              -1, 1, -1, -1, -1, 0}));  // to rank 1
  CHECK_EQ(out.send_w, (F32{0.5f, 0.0f, 0.125f, 2.0f, 0.0f, 0.0f,  //
                            0.0f, 0.25f, 0.0f, 0.0f, 0.0f, 3.0f}));
  // [T, R]: slot r * T + t
  CHECK_EQ(out.send_slot, (I32{0, 3, 1, -1, -1, 5}));
  // rows start at row_offset[r] and advance per token sent to r
  CHECK_EQ(out.send_row, (I32{0, 10, 1, -1, -1, 11}));
}

TEST(HtRoute, RowsBeyondCapacityAreDropped) {
  // Every token goes to both ranks; receiver capacity 3, rank 0 starts at row 1,
  // rank 1 at row 2.
  const I32 idx = {0, 2, 1, 3, 0, 3, 1, 2};  // T = 4, K = 2, E = 4, R = 2
  const F32 w(8, 1.0f);
  HtRouteOut out = RunHtRoute(idx, w, 4, 2, 2, 2, 3, {1, 2});
  CHECK_EQ(out.send_slot, (I32{0, 4, 1, 5, 2, 6, 3, 7}));
  // rank 0: rows 1, 2, then 3 and 4 are >= capacity -> -1; rank 1: row 2, then dropped
  CHECK_EQ(out.send_row, (I32{1, 2, 2, -1, -1, -1, -1, -1}));
  // The routing payload is still written for dropped tokens.
  CHECK_EQ(out.send_idx, (I32{0, -1, 1, -1, 0, -1, 1, -1,  //
                              -1, 0, -1, 1, -1, 1, -1, 0}));
}

TEST(HtRoute, ZeroCapacityDropsEverything) {
  const I32 idx = {0, 1};
  HtRouteOut out = RunHtRoute(idx, {1.0f, 1.0f}, 1, 2, 1, 2, 0, {0});
  CHECK_EQ(out.send_slot, (I32{0}));
  CHECK_EQ(out.send_row, (I32{-1}));
}

// ============================================================================
// HT compact (receiver side)
// ============================================================================

struct HtCompactOut {
  I32 recv_src, out_idx;
  F32 out_w;
  I32 per_expert;
  int32_t num_tokens, num_dropped;
};

HtCompactOut RunHtCompact(const I32& recv_idx, const F32& recv_w, int64_t ranks,
                          int64_t tokens, int64_t k, int64_t experts_per_rank,
                          int64_t capacity) {
  HtCompactOut out;
  out.recv_src.assign(capacity, kGarbage);
  out.out_idx.assign(capacity * k, kGarbage);
  out.out_w.assign(capacity * k, -99.0f);
  out.per_expert.assign(experts_per_rank, kGarbage);
  out.num_tokens = out.num_dropped = kGarbage;
  jax_ep::cpu::HtCompact(recv_idx.data(), recv_w.data(), ranks, tokens, k, experts_per_rank,
                         capacity, out.recv_src.data(), out.out_idx.data(), out.out_w.data(),
                         out.per_expert.data(), &out.num_tokens, &out.num_dropped);
  return out;
}

TEST(HtCompact, CompactsInSourceOrderWithPadding) {
  // R = 2, T = 2, K = 2, 2 local experts, capacity 5.
  const I32 recv_idx = {-1, -1,  // src 0 (rank 0, token 0): absent
                        1, -1,   // src 1
                        0, 1,    // src 2 (rank 1, token 0)
                        0, 0};   // src 3: same local expert twice
  const F32 recv_w = {0, 0, 0.5f, 0, 0.25f, 0.75f, 1.0f, 2.0f};
  HtCompactOut out = RunHtCompact(recv_idx, recv_w, 2, 2, 2, 2, 5);
  CHECK_EQ(out.num_tokens, 3);
  CHECK_EQ(out.num_dropped, 0);
  CHECK_EQ(out.recv_src, (I32{1, 2, 3, -1, -1}));
  CHECK_EQ(out.out_idx, (I32{1, -1, 0, 1, 0, 0, -1, -1, -1, -1}));
  CHECK_EQ(out.out_w, (F32{0.5f, 0, 0.25f, 0.75f, 1.0f, 2.0f, 0, 0, 0, 0}));
  CHECK_EQ(out.per_expert, (I32{2, 2}));  // src 3 counts once for expert 0
}

TEST(HtCompact, OverflowIsCountedAsDropped) {
  // 4 present rows, capacity 2: the first two in source order are kept.
  const I32 recv_idx = {0, 1, 1, 2, 0};  // R = 1, T = 5, K = 1
  const F32 recv_w = {1, 2, 3, 4, 5};
  HtCompactOut out = RunHtCompact(recv_idx, recv_w, 1, 5, 1, 2, 2);
  CHECK_EQ(out.num_tokens, 2);
  CHECK_EQ(out.num_dropped, 3);
  CHECK_EQ(out.recv_src, (I32{0, 1}));
  CHECK_EQ(out.out_idx, (I32{0, 1}));
  CHECK_EQ(out.out_w, (F32{1, 2}));
  CHECK_EQ(out.per_expert, (I32{1, 1}));  // only kept rows are counted
}

TEST(HtCompact, OutOfRangeLocalExpertIsCopiedNotCounted) {
  const I32 recv_idx = {5, 0};  // R = 1, T = 1, K = 2; 5 >= experts_per_rank
  HtCompactOut out = RunHtCompact(recv_idx, {0.5f, 0.5f}, 1, 1, 2, 2, 1);
  CHECK_EQ(out.num_tokens, 1);
  CHECK_EQ(out.out_idx, (I32{5, 0}));
  CHECK_EQ(out.per_expert, (I32{1, 0}));
}

TEST(HtCompact, NothingReceived) {
  HtCompactOut out = RunHtCompact({-1, -1, -1, -1}, F32(4, 0.0f), 2, 1, 2, 3, 2);
  CHECK_EQ(out.num_tokens, 0);
  CHECK_EQ(out.num_dropped, 0);
  CHECK_EQ(out.recv_src, (I32{-1, -1}));
  CHECK_EQ(out.out_idx, (I32{-1, -1, -1, -1}));
  CHECK_EQ(out.out_w, (F32{0, 0, 0, 0}));
  CHECK_EQ(out.per_expert, (I32{0, 0, 0}));
}

// ============================================================================
// LL route / compact
// ============================================================================

TEST(LlRoute, OneSlotPerTokenAndExpert) {
  // T = 2, K = 3, E = 4.
  const I32 idx = {2, -1, 2,   // token 0: expert 2 twice -> second is -1
                   0, 3, 7};   // token 1: 7 >= E -> -1, no mask
  I32 slot(6, kGarbage), mask(8, kGarbage);
  jax_ep::cpu::LlRoute(idx.data(), 2, 3, 4, slot.data(), mask.data());
  CHECK_EQ(slot, (I32{2 * 2 + 0, -1, -1, 0 * 2 + 1, 3 * 2 + 1, -1}));
  // [E, T]
  CHECK_EQ(mask, (I32{0, 1,    // expert 0
                      0, 0,    // expert 1
                      1, 0,    // expert 2
                      0, 1})); // expert 3
}

TEST(LlRoute, AllMinusOne) {
  I32 slot(4, kGarbage), mask(6, kGarbage);
  jax_ep::cpu::LlRoute(I32{-1, -1, -1, -1}.data(), 2, 2, 3, slot.data(), mask.data());
  CHECK_EQ(slot, (I32{-1, -1, -1, -1}));
  CHECK_EQ(mask, (I32(6, 0)));
}

TEST(LlCompact, OrdersBySourceRankThenToken) {
  // R = 2, E_local = 2, T = 3, rows_per_expert = 4.
  // recv_mask [R, E_local, T]
  const I32 mask = {1, 0, 1,   // rank 0, expert 0
                    0, 0, 0,   // rank 0, expert 1
                    0, 1, 0,   // rank 1, expert 0
                    1, 1, 1};  // rank 1, expert 1
  I32 src(8, kGarbage), count(2, kGarbage), gather(8, kGarbage);
  jax_ep::cpu::LlCompact(mask.data(), 2, 2, 3, 4, src.data(), count.data(), gather.data());
  CHECK_EQ(count, (I32{3, 3}));
  // source id = s * T + t
  CHECK_EQ(src, (I32{0, 2, 4, -1,    // expert 0
                     3, 4, 5, -1})); // expert 1
  // flat index (s * E_local + e) * T + t
  CHECK_EQ(gather, (I32{0, 2, 7, -1, 9, 10, 11, -1}));
}

TEST(LlCompact, TruncatesAtRowsPerExpert) {
  const I32 mask = {1, 1, 1, 1};  // R = 2, E_local = 1, T = 2
  I32 src(3, kGarbage), count(1, kGarbage), gather(3, kGarbage);
  jax_ep::cpu::LlCompact(mask.data(), 2, 1, 2, 3, src.data(), count.data(), gather.data());
  CHECK_EQ(count, (I32{3}));
  CHECK_EQ(src, (I32{0, 1, 2}));
  CHECK_EQ(gather, (I32{0, 1, 2}));
}

// ============================================================================
// Row movement
// ============================================================================

TEST(ScatterRows, ScattersToEveryValidIndexAndZeroesTheRest) {
  // src [3, 2] int32 rows, index [3, 2], out [5, 2].
  const I32 src = {10, 11, 20, 21, 30, 31};
  const I32 index = {3, -1,   // row 0 -> out 3
                     0, 4,    // row 1 -> out 0 and out 4
                     5, -3};  // row 2 -> nowhere (5 >= 5, -3 < 0)
  I32 out(10, kGarbage);
  jax_ep::cpu::ScatterRows(src.data(), 3, 2 * sizeof(int32_t), index.data(), 2, out.data(), 5);
  CHECK_EQ(out, (I32{20, 21, 0, 0, 0, 0, 10, 11, 20, 21}));
}

TEST(ScatterRows, LaterSourceRowWinsOnCollision) {
  const I32 src = {1, 2};
  const I32 index = {0, 0};  // both rows -> out 0 (index width 1)
  I32 out(2, kGarbage);
  jax_ep::cpu::ScatterRows(src.data(), 2, sizeof(int32_t), index.data(), 1, out.data(), 2);
  CHECK_EQ(out, (I32{2, 0}));
}

TEST(ScatterRows, OddRowBytes) {
  const std::vector<uint8_t> src = {1, 2, 3, 4, 5, 6};  // 2 rows of 3 bytes
  const I32 index = {1, 0};
  std::vector<uint8_t> out(9, 0xee);
  jax_ep::cpu::ScatterRows(src.data(), 2, 3, index.data(), 1, out.data(), 3);
  CHECK_EQ(out, (std::vector<uint8_t>{4, 5, 6, 1, 2, 3, 0, 0, 0}));
}

TEST(GatherRows, GathersAndZeroesInvalid) {
  const F32 src = {1, 2, 3, 4, 5, 6};  // [3, 2]
  const I32 index = {2, -1, 0, 3, 2};
  F32 out(10, -99.0f);
  jax_ep::cpu::GatherRows(src.data(), 3, 2 * sizeof(float), index.data(), 5, out.data());
  CHECK_EQ(out, (F32{5, 6, 0, 0, 1, 2, 0, 0, 5, 6}));
}

TEST(GatherRows, NoRows) {
  const F32 src = {1};
  F32 out;
  jax_ep::cpu::GatherRows(src.data(), 1, sizeof(float), nullptr, 0, out.data());
  CHECK(out.empty());
}

// ============================================================================
// GatherReduce
// ============================================================================

TEST(GatherReduce, F32WeightedSumSkipsInvalidIndices) {
  const F32 src = {1, 2, 10, 20, 100, 200};  // [3, 2]
  const I32 index = {0, 2, -1,    // out 0 = 0.5 * src0 + 0.25 * src2
                     1, 7, 1,     // out 1 = 2 * src1 + (skip) + 1 * src1
                     -1, -1, 3};  // out 2 = 0 (all invalid)
  const F32 w = {0.5f, 0.25f, 100.0f, 2.0f, 100.0f, 1.0f, 5.0f, 5.0f, 5.0f};
  F32 out(6, -99.0f);
  jax_ep::cpu::GatherReduce(FloatKind::kF32, src.data(), 3, 2, index.data(), w.data(), 3, 3,
                            out.data());
  CHECK_EQ(out, (F32{25.5f, 51.0f, 30.0f, 60.0f, 0.0f, 0.0f}));
}

TEST(GatherReduce, F32AccumulatesInOrderInFloat32) {
  // (1e8 + 1) - 1e8 is 0 in float32 (1e8 + 1 rounds to 1e8), 1 in double;
  // in the order -1e8, 1e8, 1 it is 1.
  const F32 src = {1e8f, 1.0f, -1e8f};
  const F32 w = {1, 1, 1};
  const I32 forward = {0, 1, 2};
  const I32 other = {2, 0, 1};
  float out = -99.0f;
  jax_ep::cpu::GatherReduce(FloatKind::kF32, src.data(), 3, 1, forward.data(), w.data(), 1, 3,
                            &out);
  CHECK_EQ(out, 0.0f);
  jax_ep::cpu::GatherReduce(FloatKind::kF32, src.data(), 3, 1, other.data(), w.data(), 1, 3,
                            &out);
  CHECK_EQ(out, 1.0f);
}

TEST(GatherReduce, Bf16ExactValues) {
  const std::vector<uint16_t> src = {ExactBf16(1.5f), ExactBf16(-2.0f), ExactBf16(0.25f),
                                     ExactBf16(3.0f)};  // [2, 2]
  const I32 index = {0, 1, 1, -1};
  const F32 w = {1.0f, 0.5f, -1.0f, 9.0f};
  std::vector<uint16_t> out(4, 0xdead);
  jax_ep::cpu::GatherReduce(FloatKind::kBF16, src.data(), 2, 2, index.data(), w.data(), 2, 2,
                            out.data());
  // out 0 = 1 * [1.5, -2] + 0.5 * [0.25, 3] = [1.625, -0.5]
  // out 1 = -1 * [0.25, 3] = [-0.25, -3]
  CHECK_EQ(out, (std::vector<uint16_t>{ExactBf16(1.625f), ExactBf16(-0.5f), ExactBf16(-0.25f),
                                       ExactBf16(-3.0f)}));
  CHECK_EQ(ExactBf16(1.625f), 0x3FD0);
  CHECK_EQ(ExactBf16(-3.0f), 0xC040);
}

TEST(GatherReduce, Bf16RoundsToNearestEven) {
  const uint16_t one = 0x3F80;  // 1.0; bf16 spacing at 1 is 2^-7
  // 1 + 2^-8: halfway between 0x3F80 and 0x3F81 -> even 0x3F80
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 1.0f + 0x1p-8f), 0x3F80);
  // 1 + 3 * 2^-8: halfway between 0x3F81 and 0x3F82 -> even 0x3F82
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 1.0f + 3 * 0x1p-8f), 0x3F82);
  // just above halfway -> up
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 1.0f + 0x1p-8f + 0x1p-20f), 0x3F81);
  // just below halfway -> down
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 1.0f + 0x1p-8f - 0x1p-20f), 0x3F80);
  // negative values round symmetrically
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, -(1.0f + 3 * 0x1p-8f)), 0xBF82);
  // 1/3 = 0x3EAAAAAB in f32 -> bf16 0x3EAB (round up)
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 1.0f / 3.0f), 0x3EAB);
  // pi = 0x40490FDB -> 0x4049
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, 3.14159265f), 0x4049);
}

TEST(GatherReduce, Bf16SpecialValues) {
  const uint16_t one = 0x3F80;
  // overflow of the largest finite bf16 magnitude rounds to infinity
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, one, std::numeric_limits<float>::max()), 0x7F80);
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, 0x7F7F, 1.0f), 0x7F7F);  // max finite bf16 stays
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, 0x7F80, 1.0f), 0x7F80);  // +inf
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, 0xFF80, 1.0f), 0xFF80);  // -inf
  const uint16_t nan = ReduceOne16(FloatKind::kBF16, 0x7FC0, 1.0f);
  CHECK((nan & 0x7F80) == 0x7F80 && (nan & 0x007F) != 0) << "not a NaN: " << nan;
  CHECK(nan & 0x0040) << "NaN not quiet: " << nan;
  // a signalling-looking NaN produced in f32 stays a NaN (not rounded to inf)
  const uint16_t from_f32_nan =
      ReduceOne16(FloatKind::kBF16, one, BitsToFloat(0x7F800001u));
  CHECK((from_f32_nan & 0x7F80) == 0x7F80 && (from_f32_nan & 0x007F) != 0)
      << "0x7F800001 became " << from_f32_nan;
  // zero weight of a finite value: +0
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, 0x4000, 0.0f), 0x0000);
  // bf16 subnormals pass through (same exponent range as f32)
  CHECK_EQ(ReduceOne16(FloatKind::kBF16, 0x0001, 1.0f), 0x0001);
}

TEST(GatherReduce, F16ExactValues) {
  // 1.0 = 0x3C00, -2.0 = 0xC000, 0.5 = 0x3800, 65504 = 0x7BFF
  const std::vector<uint16_t> src = {0x3C00, 0xC000, 0x3800, 0x7BFF};  // [4, 1]
  const I32 index = {0, 1, 2, 3};
  const F32 w = {1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<uint16_t> out(4, 0xdead);
  jax_ep::cpu::GatherReduce(FloatKind::kF16, src.data(), 4, 1, index.data(), w.data(), 4, 1,
                            out.data());
  CHECK_EQ(out, (std::vector<uint16_t>{0x3C00, 0xC000, 0x3800, 0x7BFF}));

  // 0.5 * 1 + 0.25 * -2 + 2 * 0.5 = 1.0
  const I32 index2 = {0, 1, 2};
  const F32 w2 = {0.5f, 0.25f, 2.0f};
  uint16_t sum = 0xdead;
  jax_ep::cpu::GatherReduce(FloatKind::kF16, src.data(), 4, 1, index2.data(), w2.data(), 1, 3,
                            &sum);
  CHECK_EQ(sum, 0x3C00);
}

TEST(GatherReduce, F16RoundsToNearestEven) {
  const uint16_t one = 0x3C00;  // f16 spacing at 1 is 2^-10
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1.0f + 0x1p-11f), 0x3C00);       // tie -> even
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1.0f + 3 * 0x1p-11f), 0x3C02);   // tie -> even
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, -(1.0f + 3 * 0x1p-11f)), 0xBC02);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1.0f / 3.0f), 0x3555);           // 0.333251953125
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 3.14159265f), 0x4248);           // 3.140625
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0.1f), 0x2E66);
}

TEST(GatherReduce, F16OverflowAndSpecialValues) {
  const uint16_t one = 0x3C00;
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 65504.0f), 0x7BFF);   // max finite
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 65519.0f), 0x7BFF);   // below the tie
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 65520.0f), 0x7C00);   // tie rounds to even = inf
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1e6f), 0x7C00);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, -1e6f), 0xFC00);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0x7C00, 1.0f), 0x7C00);    // +inf
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0xFC00, 1.0f), 0xFC00);    // -inf
  const uint16_t nan = ReduceOne16(FloatKind::kF16, 0x7E00, 1.0f);
  CHECK((nan & 0x7C00) == 0x7C00 && (nan & 0x03FF) != 0) << "not a NaN: " << nan;
  const uint16_t inf_times_zero = ReduceOne16(FloatKind::kF16, 0x7C00, 0.0f);
  CHECK((inf_times_zero & 0x7C00) == 0x7C00 && (inf_times_zero & 0x03FF) != 0)
      << "inf * 0 should be NaN, got " << inf_times_zero;
}

TEST(GatherReduce, F16Subnormals) {
  const uint16_t one = 0x3C00;
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0x1p-14f), 0x0400);         // smallest normal
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0x1p-24f), 0x0001);         // smallest subnormal
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0x1p-25f), 0x0000);         // tie -> even (0)
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0x1p-25f + 0x1p-35f), 0x0001);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 3 * 0x1p-25f), 0x0002);     // 1.5 ulp tie -> even
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 5 * 0x1p-25f), 0x0002);     // 2.5 ulp tie -> even
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 0x1p-30f), 0x0000);         // underflow
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, -0x1p-24f), 0x8001);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1023 * 0x1p-24f), 0x03FF);  // largest subnormal
  // a subnormal between the largest subnormal and the smallest normal rounds up
  CHECK_EQ(ReduceOne16(FloatKind::kF16, one, 1023.5f * 0x1p-24f), 0x0400);
  // f16 subnormal inputs decode exactly
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0x0001, 1.0f), 0x0001);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0x0001, 0x1p10f), 0x0400);
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0x03FF, 2.0f), 0x07FE);  // 2046 * 2^-24
  CHECK_EQ(ReduceOne16(FloatKind::kF16, 0x8200, 1.0f), 0x8200);
}

TEST(GatherReduce, Bf16AndF16AccumulateInFloat32) {
  // 256 + 1 + 1 in bf16 steps would stay 256 (spacing 2 at 256), but the
  // accumulator is fp32: 258 is exactly representable in bf16 (0x4381).
  const std::vector<uint16_t> src = {ExactBf16(256.0f), ExactBf16(1.0f)};
  const I32 index = {0, 1, 1};
  const F32 w = {1, 1, 1};
  uint16_t out = 0;
  jax_ep::cpu::GatherReduce(FloatKind::kBF16, src.data(), 2, 1, index.data(), w.data(), 1, 3,
                            &out);
  CHECK_EQ(out, ExactBf16(258.0f));

  // f16: 2048 + 1 + 1 = 2050 (spacing 2 at 2048).
  const std::vector<uint16_t> src16 = {0x6800 /* 2048 */, 0x3C00 /* 1 */};
  jax_ep::cpu::GatherReduce(FloatKind::kF16, src16.data(), 2, 1, index.data(), w.data(), 1, 3,
                            &out);
  CHECK_EQ(out, 0x6801);  // 2050
}

}  // namespace

int main(int argc, char** argv) { return jax_ep_test::RunAllTests("portable_ops_test", argc, argv); }
