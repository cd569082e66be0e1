"""The engine-neutral half of every engine adapter.

An inference engine meets kvtier in two places: where it schedules requests (one process) and
where its workers hold the KV tensors (one per tensor-parallel rank). Everything both places do
that does not depend on the engine lives here; an engine adapter (``kvtier.integrations.vllm``)
only translates the engine's objects and hooks into these calls:

* ``planner.Planner`` (scheduler side): a request's block keys (derived in ``kvtier.keys``),
  lookups, load plans pinned between lookup and allocation, store orders as the engine fills
  blocks, the stats.
* ``orders``: the step orders the planner hands the workers each step and the reports they send
  back, as plain records of ints.
* ``ledger.JobLedger``: settles a copy job once every rank reported it.
* ``copier.Copier`` (worker side): executes one rank's orders through a copy backend, fences
  stores against blocks the engine hands out again, and reports.
* ``backends``: the copy backend for the device the engine's KV tensors live on.

Nothing here imports an engine.
"""
