"""Rotary-embedding scaling as a checkpoint states it: the legacy `rope_theta`/`rope_scaling`
fields or transformers 5's `rope_parameters`, validated (imports no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from services.config_fields import positive_float, positive_int
from services.errors import CheckpointError


@dataclass(frozen=True)
class RopeScaling:
    """Rotary scaling from `rope_scaling`; `rope_type` is "linear" or "llama3"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def read_rope(raw: dict, source: str) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from the legacy `rope_theta`/`rope_scaling` or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters")
    if params is not None:
        key = "rope_parameters"
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise CheckpointError(f"{source}: field 'rope_parameters' must be one flat object, got {params!r}")
        theta_src = params if "rope_theta" in params else raw
    else:
        key, params, theta_src = "rope_scaling", raw.get("rope_scaling"), raw
    theta = positive_float(theta_src, "rope_theta", source, default=10000.0)
    if params is None:
        return theta, None
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: field {key!r} must be an object or null, got {params!r}")
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type not in ("linear", "llama3"):
        raise CheckpointError(
            f"{source}: field '{key}.rope_type' is {rope_type!r}; supported: 'default', 'linear', 'llama3'")
    factor = positive_float(params, "factor", f"{source}: {key}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    low = positive_float(params, "low_freq_factor", f"{source}: {key}")
    high = positive_float(params, "high_freq_factor", f"{source}: {key}")
    if high <= low:
        raise CheckpointError(f"{source}: field '{key}.high_freq_factor' ({high}) must exceed low_freq_factor ({low})")
    original = positive_int(params, "original_max_position_embeddings", f"{source}: {key}")
    return theta, RopeScaling("llama3", factor, low, high, original)
