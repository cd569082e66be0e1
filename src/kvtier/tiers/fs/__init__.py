"""The ``fs`` tier: blocks as files on a local disk or a shared filesystem.

``tier.py`` is the storage (``FsTier``), ``files.py`` the file primitives that are safe in a
directory others can write to, ``index.py`` the index and capacity accounting, ``options.py`` its
options.
"""

from kvtier.tiers.fs.options import Options
from kvtier.tiers.fs.tier import FsTier

__all__ = ["FsTier", "Options"]
