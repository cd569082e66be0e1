"""One host pool and one block index for every engine on a node that names the same share
(``pool.share``): no server, the engines coordinate through the shared memory itself.

``segment`` creates or attaches the file, ``layout`` lays the index out in it, ``locks`` are the
kernel-held locks between engines, ``table`` the key -> slot table, ``index`` the operations
(pins, reservations, publication, eviction, reaping dead engines), ``checks`` its invariants.
This package knows slots and keys only, beside the pool: the ``TieredCache`` an engine's planner
uses over it is ``kvtier.cache.shared.SharedTieredCache``, built by ``kvtier.cache.factory``.
"""
