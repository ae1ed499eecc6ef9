"""Writes cuda/ll_dispatch.cu, with the LL dispatch headers it includes pasted
in (one file), to stdout with phase marks in the one-rank LL dispatch.

For tools/ll_one_rank_probe.cu built with -DLL_PROBE: thread 0 of every block
stores clock64() at six points of ll_dispatch's one-rank path (0: its start,
1-4: see ANCHORS, 5: the end) and %globaltimer at the start and the end.
Without -DLL_PROBE the marks compile to nothing. Not part of the library; each
anchor must occur exactly once, or this fails.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "cuda" / "ll_dispatch.cu"
# The headers whose code the marks go into (included once, by ll_dispatch.cu).
PASTED = ("cuda/ll_dispatch_send.cuh", "cuda/ll_dispatch_recv.cuh")

MARK_MACRO = r"""#ifdef LL_PROBE
__device__ long long g_probe_clk[1024 * 8];
__device__ unsigned long long g_probe_gt[1024 * 2];
__device__ __forceinline__ unsigned long long probe_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define PROBE_MARK(k)                                                        \
  do {                                                                       \
    if (threadIdx.x == 0) {                                                  \
      g_probe_clk[blockIdx.x * 8 + (k)] = clock64();                         \
      if ((k) == 0) g_probe_gt[blockIdx.x * 2] = probe_globaltimer();        \
      if ((k) == 5) g_probe_gt[blockIdx.x * 2 + 1] = probe_globaltimer();    \
    }                                                                        \
  } while (0)
#else
#define PROBE_MARK(k) do {} while (0)
#endif
"""

# (anchor, mark placed right after it). Marks 1-4 sit in both ways of the
# one-rank dispatch (only one runs per launch): the routing table's (1: its
# routing pass's first barrier, 2: the pass's end, 3: the fill of rows past
# count done, 4: the token loop done) and the per-block questions' (1: thread
# 0 reaching the barrier, 2: past it, 3: the fill done, 4: the pairs done).
ANCHORS = [
    ('static_assert(kSend && kRecv, "one rank: the one-call op only");', 0),
    ("  if (threadIdx.x == 0) *s_invalid = 0;\n  __syncthreads();", 1),
    ("  if (blockIdx.x == 0 && invalid != 0) atomicAdd(s_invalid, invalid);\n  __syncthreads();", 2),
    ("      if (args.out_weights != nullptr) args.out_weights[out_row] = 0.0f;\n    }\n  }\n", 3),
    ("    dispatch_single_rank<kFp8>(ctx, args, s_masked, smem, &s_void_call);", 4),
    ("    s_rank_masked = mask_word;\n  }\n", 1),
    ("  __syncthreads();\n  uint4 sums = make_uint4(0u, 0u, 0u, 0u);", 2),
    ("        if (args.out_weights != nullptr) args.out_weights[out_row] = 0.0f;\n      }\n    }\n  }\n",
     3),
    ("      void_call = dispatch_single_rank_by_queries<kFp8>(ctx, args);", 4),
    ("    finish_single_rank_call(ctx, seq, void_call, &counters->ll_dispatch_seq, kOpLlDispatch, 0);",
     5),
]


def marked(source: str) -> str:
  for anchor, mark in ANCHORS:
    if source.count(anchor) != 1:
      raise SystemExit(f"ll_one_rank_probe_marks: anchor of mark {mark} found "
                       f"{source.count(anchor)} times in {KERNELS} (expected once)")
    source = source.replace(anchor, f"{anchor} PROBE_MARK({mark});")
  namespace = "namespace jax_ep::cuda {"
  return source.replace(namespace, MARK_MACRO + namespace, 1)


def amalgamated() -> str:
  """ll_dispatch.cu with each PASTED header's text in place of its #include
  (the marks need PROBE_MARK defined before the code they go into)."""
  source = KERNELS.read_text()
  for header in PASTED:
    include = f'#include "{header}"'
    if source.count(include) != 1:
      raise SystemExit(f"ll_one_rank_probe_marks: {KERNELS} does not include {header} once")
    source = source.replace(include, (ROOT / header).read_text())
  return source


if __name__ == "__main__":
  sys.stdout.write(marked(amalgamated()))
