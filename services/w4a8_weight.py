"""w4a8's weights: int4's values and group parameters (services/int4_weight.py), stored in 16-row panels.

Legend: N output features, K input features, Kp = K padded to whole 64-column blocks, P = ceil(N / 16) panels,
G = 32 columns per group. The products (services/kernels/w4a8_candidates.py) round x to int8 per group and
multiply it by the 4-bit levels with int8 dot products (vpdpbusd: four columns a 32-bit lane), so each lane of
a register holds one W row: panel p, column octet o is 64 bytes, lane r (row 16p + r), byte i holding
q[16p + r, 8o + i] in its low nibble and q[16p + r, 8o + 4 + i] in its high one; one AND gives columns 8o..8o+3
of 16 rows, a shift and an AND the next four — no transposes, whatever the number of rows of x. The group
parameters follow the same lanes: scale and low [P, Kp / G, 16] float16. Rows past N are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.int4_weight import GROUP, Int4Weight

PANEL = 16  # W rows per panel: one 512-bit register of 32-bit lanes


@dataclass(frozen=True, slots=True)
class W4A8Weight(Int4Weight):
    """packed [P, Kp / 8 * 64] uint8, scale and low [P, Kp / G * 16] float16 (the module's layout)."""

    out_features: int = 0  # N (the panels' rows past it are zeros)

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> W4A8Weight:
        return cls.of(Int4Weight.quantize(weight))

    @classmethod
    def of(cls, int4: Int4Weight) -> W4A8Weight:
        """The same values as `int4`, in panels."""
        n, kp = int4.packed.shape[0], int4.packed.shape[1] * 2
        panels = -(-n // PANEL)
        q = torch.zeros(panels * PANEL, kp, dtype=torch.uint8)
        q[:n] = int4.levels()
        octets = q.view(panels, PANEL, kp // 8, 2, 4).permute(0, 2, 1, 3, 4)  # [P, Kp / 8, 16, lo/hi, 4]
        packed = (octets[..., 0, :] | (octets[..., 1, :] << 4)).reshape(panels, kp * 8).contiguous()
        return cls(packed, _in_panels(int4.scale, panels), _in_panels(int4.low, panels), int4.in_features, out_features=n)

    def levels(self) -> torch.Tensor:
        """q: [N, Kp] uint8 in 0..15, in column order (padding included)."""
        panels, kp = self.packed.shape[0], self.packed.shape[1] // 8
        octets = self.packed.view(panels, kp // 8, PANEL, 1, 4)
        both = torch.cat([octets & 15, octets >> 4], dim=3)  # [P, Kp / 8, 16, 2, 4]
        return both.permute(0, 2, 1, 3, 4).reshape(panels * PANEL, kp)[: self.out_features]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, kp = self.out_features, self.packed.shape[1] // 8
        q = self.levels().float().view(n, kp // GROUP, GROUP)
        w = q * _by_row(self.scale, n)[..., None] + _by_row(self.low, n)[..., None]
        return w.view(n, kp)[:, : self.in_features].to(dtype)  # [N, K]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))


def _in_panels(params: torch.Tensor, panels: int) -> torch.Tensor:
    """[N, Kp / G] -> [P, Kp / G * 16]: each panel's rows as the lanes of each group."""
    n, groups = params.shape
    padded = torch.zeros(panels * PANEL, groups, dtype=params.dtype, device=params.device)
    padded[:n] = params
    return padded.view(panels, PANEL, groups).transpose(1, 2).reshape(panels, groups * PANEL).contiguous()


def _by_row(params: torch.Tensor, n: int) -> torch.Tensor:
    """[P, Kp / G * 16] float16 -> [N, Kp / G] float32."""
    panels = params.shape[0]
    return params.view(panels, -1, PANEL).transpose(1, 2).reshape(panels * PANEL, -1)[:n].float()
