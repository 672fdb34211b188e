// Where a tensor's memory lives. The API is the same in every build: a CUDA device can always be
// named, and a build without CUDA (SWITCHYARD_CUDA=OFF) throws switchyard::BackendError "not
// built with CUDA" when memory or a kernel on it is asked for.
#pragma once

#include <cstdint>
#include <string>

namespace switchyard {

/// Kinds of memory: `cpu` (host memory) and `cuda` (a CUDA device's global memory).
enum class DeviceKind : uint8_t { cpu, cuda };

/// A device: its kind and, for CUDA, the device ordinal (`index`, >= 0; 0 for the CPU).
struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int32_t index = 0;

  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  friend bool operator==(const Device& a, const Device& b) {
    return a.kind == b.kind && a.index == b.index;
  }
  friend bool operator!=(const Device& a, const Device& b) { return !(a == b); }
};

/// The host.
inline constexpr Device kCpu{DeviceKind::cpu, 0};
/// CUDA device `index` (not checked against the devices present: allocating on it is).
inline constexpr Device cuda_device(int32_t index = 0) { return Device{DeviceKind::cuda, index}; }

/// "cpu" or "cuda:0" (torch's spelling), for messages.
std::string device_str(const Device& device);

/// Whether this library was built with the CUDA backend (SWITCHYARD_CUDA=ON).
bool built_with_cuda();
/// Number of CUDA devices visible to this process: 0 in a build without CUDA or on a machine
/// without a GPU (or driver). Never throws.
int cuda_device_count();

}  // namespace switchyard
