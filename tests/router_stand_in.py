"""The real router app in front of stand-in workers (no Ray, no model): it lives in the installed
`benchmarks.router_stand_in` (benchmarks/boundary_stalls.py uses it too); re-exported here."""

from benchmarks.router_stand_in import (  # noqa: F401
    StandInOrchestrator,
    StandInPool,
    served,
    state,
    tokenizer,
)
