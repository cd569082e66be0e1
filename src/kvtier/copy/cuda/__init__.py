"""The CUDA copy backend (``backend.CudaCopyBackend``) with its strategies (``dma``, ``staged``,
``direct``), device resources, plans and the native executor (``executor.c``, built on first use).
"""

from kvtier.copy.cuda.backend import CudaCopyBackend
from kvtier.copy.cuda.options import CudaCopyOptions

__all__ = ["CudaCopyBackend", "CudaCopyOptions"]
