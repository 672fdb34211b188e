// Device names and what the build offers.
#include "switchyard/device.h"

#include "cuda/cuda_backend.h"

namespace switchyard {

std::string device_str(const Device& device) {
  if (device.is_cpu()) return "cpu";
  if (device.is_cuda()) return "cuda:" + std::to_string(device.index);
  return "device(kind=" + std::to_string(static_cast<int>(device.kind)) + ")";
}

bool built_with_cuda() { return cuda::built(); }

int cuda_device_count() { return cuda::device_count(); }

}  // namespace switchyard
