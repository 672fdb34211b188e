// The CUDA backend's ops (SWITCHYARD_CUDA=ON). No kernel exists yet: each op of the backend seam
// (src/backend/backend.h) reaches no_kernel() on a CUDA device, which says so. Compiled by nvcc,
// so a CUDA build proves the toolchain (nvcc with the host C++ compiler) works before the first
// kernel lands here.
#include <string>

#include "cuda/cuda_backend.h"  // C++17 headers only: nvcc builds this file as C++17
#include "switchyard/error.h"

namespace switchyard::cuda {

void no_kernel(const char* op, const char* kernel, const Device& device) {
  throw BackendError(std::string("[") + (op ? op : kernel) + "] " + (op ? kernel : "op") +
                     " has no CUDA kernel yet (device " + device_str(device) + ")");
}

}  // namespace switchyard::cuda
