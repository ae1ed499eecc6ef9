// The timing loop the row probes share (tools/sm_bandwidth.cu,
// tools/pair_combine_probe.cu): `warmups` launches, then `repeats` times
// `launches` launches on one stream between two events; the per-launch times
// of the repeats, sorted (median: [repeats / 2], min: [0]), in us. Not part of
// the library.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

template <typename Launch>
std::vector<float> time_launches(Launch launch, cudaStream_t stream, int warmups, int repeats,
                                 int launches) {
  for (int i = 0; i < warmups; ++i) launch();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<float> per;
  for (int r = 0; r < repeats; ++r) {
    cudaEventRecord(e0, stream);
    for (int i = 0; i < launches; ++i) launch();
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    per.push_back(ms * 1000.0f / launches);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(per.begin(), per.end());
  return per;
}
