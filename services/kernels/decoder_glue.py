"""The element-wise glue of a decoder layer: the residual add with the RMSNorm after it, the
rotary rotation of q and k, and the MLP's silu(gate) * up. On a CPU with the native build
(decoder_glue.cpp) each is one pass over its rows; elsewhere (a GPU, `kernels="torch"`, no
compiler) torch's operators in Hugging Face's order. Both compute HF's values in the model's dtype; the native sum of squares may differ from
torch's in its last float32 bit.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from services.rotary import RotaryEmbedding


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF's LlamaRMSNorm: normalise in float32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class DecoderGlue:
    def __init__(self, native: ModuleType | None) -> None:
        self.native = native  # the native build, or None: torch's operators

    def residual_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta)); h: [N, D] is updated in place on the native path (it
        must be the forward's own residual stream); delta None: h unchanged, only normalised."""
        if self._native_for(h):
            return h, self.native.residual_rms_norm(h, delta, weight, eps)
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """x: [N, heads, Dh] rotated by the tables [N, 1, Dh]: in place on the native path, else a new tensor."""
        if self._native_for(x) and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
            self.native.rotate_heads(x, cos.squeeze(1), sin_signed.squeeze(1))
            return x
        return RotaryEmbedding.apply(x, cos, sin_signed)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [N, 2F] -> silu(gate) * up [N, F]: one native pass where the build has it (AVX-512 BW/VL or
        AVX2), else torch's two operators. Both round silu to the dtype and then the product; the native exp is within
        ~1e-7 of torch's, so a 16-bit result could move by one unit, very rarely (decoder_glue.cpp)."""
        if self._native_for(gate_up) and hasattr(self.native, "silu_mul") and gate_up.is_contiguous():
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _native_for(self, x: torch.Tensor) -> bool:
        return self.native is not None and x.device.type == "cpu"
