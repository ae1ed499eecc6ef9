// Compile-time check for //cuda:jax_ep_cuda_qp (see cuda/BUILD.bazel).
//
// That target compiles cuda/*.cu and this file with the same nvcc flags and
// include paths, against NVSHMEM 3.8.0 (@nvshmem_qp) instead of the runtime's
// 3.4.5 wheel. Compiling this file proves that, in that environment,
// cuda/transport.cuh selects its per-queue-pair RDMA branch -- the one that
// calls nvshmemx_qp_uint8_put_nbi_warp / nvshmemx_qp_signal_op -- so that
// branch is what the kernels in cuda/*.cu were compiled with. (Those NVSHMEM
// device functions are always-inline: no symbol of theirs survives in the
// objects to check afterwards.)
#include "cuda/transport.cuh"

static_assert(JAX_EP_HAVE_QP_API == 1,
              "cuda/transport.cuh did not enable the QP API branch with these NVSHMEM headers "
              "(expected NVSHMEM >= 3.5.19, see @nvshmem_qp)");
