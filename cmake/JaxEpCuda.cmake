# The CUDA extension jax_ep._jax_ep_cuda: kernels (cuda/*.cu, nvcc, -rdc,
# sm_90) device-linked against the NVSHMEM wheel's libnvshmem_device.a, FFI
# glue (xla_ffi/cuda/*.cc, host compiler), static cudart, NVSHMEM symbols kept
# private with -Wl,--exclude-libs,ALL. Included from CMakeLists.txt unless
# JAX_EP_CUDA=OFF; with AUTO a missing nvcc or NVSHMEM wheel skips it.

include(CheckLanguage)
check_language(CUDA)

# JAX_EP_NVSHMEM_DIR (-D, e.g. another NVSHMEM for the per-QP API: tools/gpu_check.sh
# qp) wins; otherwise the installed nvidia-nvshmem-cu13 wheel's directory.
if(NOT JAX_EP_NVSHMEM_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
            "import importlib.util as u; s = u.find_spec('nvidia.nvshmem'); print(list(s.submodule_search_locations)[0] if s else '')"
    OUTPUT_VARIABLE _jax_ep_wheel_nvshmem OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  set(JAX_EP_NVSHMEM_DIR "${_jax_ep_wheel_nvshmem}" CACHE PATH
      "nvidia/nvshmem directory of the nvidia-nvshmem-cu13 wheel" FORCE)
endif()

set(_jax_ep_cuda_missing "")
if(NOT CMAKE_CUDA_COMPILER)
  set(_jax_ep_cuda_missing "nvcc was not found")
elseif(NOT EXISTS "${JAX_EP_NVSHMEM_DIR}/lib/libnvshmem_device.a"
       OR NOT EXISTS "${JAX_EP_NVSHMEM_DIR}/lib/libnvshmem_host.so.3")
  set(_jax_ep_cuda_missing "the nvidia-nvshmem-cu13 wheel was not found (JAX_EP_NVSHMEM_DIR='${JAX_EP_NVSHMEM_DIR}')")
endif()
if(_jax_ep_cuda_missing)
  if(JAX_EP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "jax_ep: JAX_EP_CUDA=ON but ${_jax_ep_cuda_missing}")
  endif()
  message(STATUS "jax_ep: skipping the CUDA extension: ${_jax_ep_cuda_missing}")
  return()
endif()

enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
message(STATUS "jax_ep: building the CUDA extension with NVSHMEM from ${JAX_EP_NVSHMEM_DIR}")

# CUDA 13 moved CCCL (cuda/std, thrust, cub) under include/cccl; nvshmem.h needs it.
set(JAX_EP_CCCL_INCLUDE "")
foreach(_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  if(EXISTS "${_dir}/cccl")
    list(APPEND JAX_EP_CCCL_INCLUDE "${_dir}/cccl")
  endif()
endforeach()

file(GLOB JAX_EP_CUDA_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/cuda/*.cu")
file(GLOB JAX_EP_FFI_CUDA_SOURCES CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/xla_ffi/cuda/*.cc")

nanobind_add_module(_jax_ep_cuda NB_STATIC
  xla_ffi/cuda_module.cc ${JAX_EP_FFI_CUDA_SOURCES} ${JAX_EP_CUDA_SOURCES})
set_target_properties(_jax_ep_cuda PROPERTIES
  CUDA_ARCHITECTURES 90
  CUDA_SEPARABLE_COMPILATION ON
  CUDA_RESOLVE_DEVICE_SYMBOLS ON
  CXX_VISIBILITY_PRESET hidden
  CUDA_VISIBILITY_PRESET hidden)
target_include_directories(_jax_ep_cuda PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR} ${XLA_FFI_INCLUDE_DIR}
  "${JAX_EP_NVSHMEM_DIR}/include" ${JAX_EP_CCCL_INCLUDE} ${CUDAToolkit_INCLUDE_DIRS})
target_compile_definitions(_jax_ep_cuda PRIVATE JAX_EP_BUILT_WITH_JAXLIB="${JAXLIB_VERSION}")
target_compile_options(_jax_ep_cuda PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -lineinfo>)
target_link_directories(_jax_ep_cuda PRIVATE "${JAX_EP_NVSHMEM_DIR}/lib")
target_link_libraries(_jax_ep_cuda PRIVATE
  "${JAX_EP_NVSHMEM_DIR}/lib/libnvshmem_device.a"
  -l:libnvshmem_host.so.3
  CUDA::cudart_static)
target_link_options(_jax_ep_cuda PRIVATE "LINKER:--exclude-libs,ALL")
install(TARGETS _jax_ep_cuda LIBRARY DESTINATION jax_ep)
