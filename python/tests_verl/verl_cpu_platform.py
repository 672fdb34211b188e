"""A CPU platform for verl (imported by verl through VERL_USE_EXTERNAL_MODULES, see verl_cpu.py).

verl.plugin.platform.PlatformRegistry is verl's documented extension point for new devices; verl
0.9.1 has none for the CPU. "cpu" maps get_device_name() to "cpu", torch.cpu as the device module
and gloo for torch.distributed, which is all the FSDP engine asks of a platform in one process."""
import contextlib

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = torch.cpu

    def is_available(self): return True
    # verl moves tensors with .to(get_device_id()); an index would mean cuda:<index>.
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, device_index): pass
    def synchronize(self, device_index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, device_index=0): return (None, None)
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "CPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None
