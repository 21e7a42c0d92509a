"""pdserve's shared core: the engine both workers run, and the types the router shares with them.

`Engine` is imported lazily so that the router can use the torch-free modules of this package
(protocol, tokenizer, sampling params, config) without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine import Engine

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from services.engine import Engine

        return Engine
    raise AttributeError(f"module 'services' has no attribute {name!r}")
