"""Bridge probes for switchyard's tests and the bridge benchmark. Not public API: no stability
promise, not in the API reference.

borrow_device(t) -> 'cpu' | 'cuda:N': the device of the engine's view of tensor t.
borrow_info(t) -> (address, shape, dtype name) of the engine's view of t (no copy for a contiguous
CPU tensor).
clone(t) -> an engine-owned copy of t, handed to torch through the zero-copy path.
full(shape, dtype, value) -> an engine-owned tensor filled with value, handed to torch the same way.
"""
from ._switchyard._testing import borrow_device, borrow_info, clone, full  # noqa: F401
