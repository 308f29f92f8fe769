// Force-included (nvcc -include) into every translation unit of libfa3_peer.so.
// FA3's hopper/cuda_check.h makes CHECK_CUDA / CHECK_CUTLASS call exit(1) on
// failure, which would kill the host process (e.g. a Python benchmark).  We
// include it first (it is #pragma once, so the later include in
// flash_fwd_launch_template.h is a no-op) and redefine the macros to throw a
// C++ exception instead; fa3_peer_fwd() catches it and returns nonzero.
#pragma once
#include <stdexcept>
#include <string>
#include <cuda_runtime.h>
#include "cuda_check.h"

namespace fa3_peer {
struct cuda_failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};
}

#undef CHECK_CUDA
#define CHECK_CUDA(call)                                                                       \
    do {                                                                                       \
        cudaError_t status_ = (call);                                                          \
        if (status_ != cudaSuccess) {                                                          \
            throw ::fa3_peer::cuda_failure(std::string("CUDA error (") + __FILE__ + ":" +      \
                                           std::to_string(__LINE__) + "): " +                  \
                                           cudaGetErrorString(status_));                       \
        }                                                                                      \
    } while (0)

#undef CHECK_CUDA_KERNEL_LAUNCH
#define CHECK_CUDA_KERNEL_LAUNCH() CHECK_CUDA(cudaGetLastError())

#undef CHECK_CUTLASS
#define CHECK_CUTLASS(call)                                                                    \
    do {                                                                                       \
        cutlass::Status status_ = (call);                                                      \
        if (status_ != cutlass::Status::kSuccess) {                                            \
            cudaError_t last_ = cudaGetLastError();                                            \
            throw ::fa3_peer::cuda_failure(std::string("CUTLASS error (") + __FILE__ + ":" +   \
                                           std::to_string(__LINE__) + "): " +                  \
                                           cutlass::cutlassGetStatusString(status_) +          \
                                           " / " + cudaGetErrorString(last_));                 \
        }                                                                                      \
    } while (0)
