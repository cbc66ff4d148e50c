"""Manager V2: a KV cache manager whose allocation state lives on the device.

Three modules, one concept: ``block_pool`` (the pure jitted functions over one layer group's
``DeviceBlockPool`` pytree: free stack, reference counts, block tables, hashed prefix index),
``manager`` (``KVCacheManagerV2``, the host face the scheduler drives, and the interface
extension ``DeviceBlockPoolManager``) and ``decode`` (``decode_steps``, several decode steps in
one device program, and ``DeviceDecode``, the engine's dispatch of it).

The engine picks V2 or V1 once (``kvjax.engine.manager_choice``); nothing else asks which.
"""

from kvjax.engine.manager_v2.block_pool import DeviceBlockPool, init_block_pool
from kvjax.engine.manager_v2.decode import DeviceDecode, decode_steps, device_decode_for
from kvjax.engine.manager_v2.manager import DeviceBlockPoolManager, KVCacheManagerV2

__all__ = [
    "DeviceBlockPool",
    "DeviceBlockPoolManager",
    "DeviceDecode",
    "KVCacheManagerV2",
    "decode_steps",
    "device_decode_for",
    "init_block_pool",
]
