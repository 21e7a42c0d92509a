"""Group-wise int4 weights: a quarter of bf16's bytes per decode step, made on the fly from any checkpoint.

Legend: N output features (rows), K input features, Kp = K rounded up to whole 64-column blocks
(and whole groups), G = GROUP columns sharing one scale and one offset.

Asymmetric (min/max) per group of G = 32 along K: w[n, k] ~= q[n, k] * scale[n, g] + low[n, g],
q in 0..15, g = k // G. Why asymmetric: 16 levels spread over [min, max] of each group, where a
symmetric grid wastes a level and is sized by the larger side; it costs the kernel nothing (the
offset term is sum_g low[n, g] * sum(x over g), one short dot per row). Why G = 32: measured on
stories260K and SmolLM2-135M (docs/quantization.md), 64 doubles the logprob error for 3% fewer bytes.
scale and low are float16 (llama.cpp's Q4 formats store theirs in 16 bits too): 0.625 bytes/weight.
A group whose values are already a llama.cpp Q4_0 block's ((q - 8) d, a float16 d) keeps that grid exactly
(scale d, negative where the block's largest magnitude is positive, low -8 d); a Q4_1 block's (q d + m) is
what the min/max grid finds anyway. So a Q4_0 or Q4_1 GGUF's matrices reach the kernels as the file holds them.

Storage order, chosen for the native kernel (services/kernels/int4_linear.cpp): each 64-column block
is 32 bytes; the kernel loads them into both halves of a 512-bit register, shifts the upper half's
bytes right by 4, masks, and interleaves bytes with 0x43 (`unpacklo/hi_epi8`), which makes the bf16
values 128 + q, in an order where the vdpbf16ps lanes alternate between the block's two groups.
`BLOCK_ORDER[e]` is where column e of a block lands in that register: byte e' < 32 is byte e' of
the block's low nibbles, e' >= 32 byte e' - 32's high nibbles.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

GROUP = 32
BLOCK = 64  # columns per 32 stored bytes


def _block_order() -> torch.Tensor:
    # column e -> register r (unpacklo: 0, unpackhi: 1) and word w, even vdpbf16ps lanes (word pairs)
    # holding the block's first group, odd lanes its second (int4_block.h: block_slot); unpacklo takes
    # bytes 16L + 0..7 of each 128-bit lane L as words 8L + 0..7, unpackhi bytes 16L + 8..15
    e = torch.arange(BLOCK)
    group, within = e // 32, e % 32
    r, w = within // 16, 4 * ((within % 16) // 2) + 2 * group + within % 2
    return 16 * (w // 8) + w % 8 + 8 * r


BLOCK_ORDER = _block_order()  # [64] column -> register byte


@dataclass(frozen=True, slots=True)
class Int4Weight:
    """w[n, k] ~= q[n, k] * scale[n, k // GROUP] + low[n, k // GROUP] for k < in_features."""

    packed: torch.Tensor  # [N, Kp / 2] uint8, two q per byte in BLOCK_ORDER (see the module's docstring)
    scale: torch.Tensor  # [N, Kp / G] float16
    low: torch.Tensor  # [N, Kp / G] float16: each group's value at q = 0 (its minimum; a Q4_0 block's -8 d)
    in_features: int  # K; the columns past it are padding, multiplied by zeros
    rows_dropped: bool = False  # `without_rows`: `packed` keeps its shape, not its bytes

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weight:
        if weight.dim() != 2 or weight.shape[1] == 0:
            raise ValueError(f"int4 quantizes a 2-D weight [N, K] with K > 0, got shape {tuple(weight.shape)}")
        n, k = weight.shape
        kp = -(-k // BLOCK) * BLOCK
        w = torch.zeros(n, kp, dtype=torch.float32, device=weight.device)
        w[:, :k] = weight.float()
        w[:, k:] = w[:, k - 1 : k]  # padding repeats the last column: it widens no group's range
        if not bool(w.abs().max() <= 60000):
            raise ValueError("int4 keeps its scales in float16: weights must be finite and below 60000 in magnitude")
        groups = w.view(n, kp // GROUP, GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        # float16 parameters, rounded outwards (the minimum down, the step up), so that the grid they
        # make still covers [low, high]: no value is clamped, and each is within half a step
        low16 = _rounded(low, down=True)
        scale16 = _rounded(torch.where(high > low, (high - low16.float()) / 15, torch.ones_like(low)), down=False)
        scale16 = torch.where(scale16 > 0, scale16, torch.full_like(scale16, 6e-8))  # a range below float16's least
        q = torch.round((groups - low16.float()[..., None]) / scale16.float()[..., None]).clamp_(0, 15)
        if weight.dtype == torch.float32:  # a GGUF's dequantized matrices come as float32 (bf16 cannot hold them)
            every = max(1, n // 64)  # 64 rows first: a float checkpoint's weight has no such group, and skips the rest
            if _short_spans(groups[::every], low[::every], high[::every])[0].any():
                short, step = _short_spans(groups, low, high)
                scale16[short], low16[short] = step.half(), low[short].half()
                levels = (groups[short] - low16[short].float()[:, None]) / scale16[short].float()[:, None]
                q[short] = levels.round_().clamp_(0, 15)
            on_grid, d, levels = _q4_0_blocks(groups)
            scale16[on_grid], low16[on_grid], q[on_grid] = d.half(), (-8 * d).half(), levels
        return cls(_pack(q.view(n, kp).to(torch.uint8)), scale16.contiguous(), low16.contiguous(), k)

    def levels(self) -> torch.Tensor:
        """q: [N, Kp] uint8 in 0..15, in column order (padding included)."""
        if self.rows_dropped:
            raise RuntimeError("this int4 weight dropped its row layout (its kernels read the panel copy)")
        return _unpack(self.packed)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        n, kp = self.packed.shape[0], self.packed.shape[1] * 2
        q = self.levels().float().view(n, kp // GROUP, GROUP)
        w = q * self.scale.float()[..., None] + self.low.float()[..., None]
        return w.view(n, kp)[:, : self.in_features].to(dtype)  # [N, K]

    @property
    def group_size(self) -> int:
        return GROUP

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device) -> Int4Weight:
        return dataclasses.replace(self, packed=self.packed.to(device), scale=self.scale.to(device),
                                   low=self.low.to(device))

    def without_rows(self) -> Int4Weight:
        """The same weight without the row layout's bytes, for one whose every kernel reads a copy in another layout
        (int4_panels.py, with its own parameters): `packed`, `scale` and `low` become shapes without storage, which the
        native kernels refuse (not contiguous) and `levels` too, so nothing reads zeros in their place."""
        def stub(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros(1, 1, dtype=t.dtype, device=t.device).expand(t.shape)
        return dataclasses.replace(self, packed=stub(self.packed), scale=stub(self.scale), low=stub(self.low),
                                   rows_dropped=True)

    def with_packed(self, packed: torch.Tensor) -> Int4Weight:
        """The same weight reading its nibbles from `packed` (a copy placed elsewhere, e.g. huge pages)."""
        return dataclasses.replace(self, packed=packed)


def on_four_bit_grid(weight: torch.Tensor, rows: int = 64) -> bool:
    """Whether `weight` [N, K] already holds 4-bit values, as a GGUF's Q4_0 / Q4_1 / Q4_K matrices do (read as float32
    on a CPU: services/checkpoint.py): int4's own grid (`Int4Weight.quantize`) holds 99% of `rows` evenly spread rows'
    values within a 500th of their group's largest magnitude — as near as its float16 parameters come to a Q4_K
    group's step and minimum, where rounding values of more levels to 16 moves most by more (about a sixtieth of the
    group's range on average). A float checkpoint's matrix never passes, a Q5_0 / Q6_K / Q8_0 one does not, and a
    16-bit tensor is not checked: it cannot hold a Q4 block's float32 values."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or 0 in weight.shape:
        return False
    sample = spread_rows(weight, rows)
    try:
        int4 = Int4Weight.quantize(sample)
    except ValueError:  # not finite, or past float16's range: no 4-bit file made it
        return False
    k = sample.shape[1]
    padded = torch.cat([sample, sample[:, -1:].expand(-1, -k % GROUP)], dim=1).view(sample.shape[0], -1, GROUP)
    tolerance = (padded.abs().amax(dim=2) / 500).repeat_interleave(GROUP, dim=1)[:, :k]
    close = (int4.dequantize(torch.float32) - sample).abs() <= tolerance
    return close.float().mean().item() >= 0.99


def spread_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """`rows` rows of `weight` [N, K] evenly spread from the first to the last (all N where N <= rows): the sample the
    per-matrix format checks read (on_four_bit_grid, quantized_weight.FileFormats)."""
    return weight[torch.linspace(0, weight.shape[0] - 1, min(rows, weight.shape[0])).round().long()]


def _short_spans(groups: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which groups [N, Kp / G, G] (float32; low, high: their [N, Kp / G] minima and maxima) hold values on k equal
    steps from their minimum to their maximum, k < 15 and not a divisor of 15 — a llama.cpp Q4_K (or Q4_1) block whose
    levels do not reach both 0 and 15: a fifth of the groups of a Q4_K_M file's Q4_K matrices, which the min/max
    grid's 15 steps would move by up to half a step. Those keep their own step and minimum (in float16, which rounds
    the file's `d * scale` and minimum: values within ~1.5% of a step). Returns the mask [N, Kp / G] and the steps
    [M] of the groups it holds. Four columns a group are tried against each k first: a float checkpoint's groups
    rarely pass, so few groups are checked whole."""
    width = high - low
    safe = torch.where(width > 0, width, 1)[..., None]
    probe = (groups[..., :4] - low[..., None]) / safe  # [N, Kp / G, 4] in 0..1
    steps = torch.zeros_like(low)
    for k in (14, 13, 12, 11, 10, 9, 8, 7, 6, 4, 2):
        maybe = (steps == 0) & (width > 0) & ((probe * k - (probe * k).round()).abs() <= 1e-3).all(dim=2)
        if maybe.any():
            levels = (groups[maybe] - low[maybe][:, None]) / safe[maybe] * k  # [M, G]
            maybe[maybe.clone()] = ((levels - levels.round()).abs() <= 1e-3).all(dim=1)
            steps[maybe] = width[maybe] / k
    mask = steps > 0
    return mask, steps[mask]


def _q4_0_blocks(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which groups [N, Kp / G, G] (float32) already hold a llama.cpp Q4_0 block's values exactly: w = (q - 8) d, q in
    0..15, d a float16 number, the largest magnitude at q = 0 (so d = -that value / 8, negative where it is
    positive). Those keep their own grid, scale d and low -8 d (both exact in float16), instead of a new one whose
    rounding would move most values (a Q4_0 GGUF's weights then reach the kernels unchanged). Returns the mask
    [N, Kp / G] and, for the groups it holds, d [M] and the levels q [M, G] (float32)."""
    peak = groups.gather(2, groups.abs().argmax(dim=2, keepdim=True)).squeeze(2)
    d = -peak / 8
    mask = (d != 0) & (d.half().float() == d)  # few groups of a float checkpoint's weights: only those are divided
    levels = groups[mask] / d[mask][:, None] + 8  # exact where the values are (q - 8) d: integers
    whole = ((levels == levels.round()) & (levels >= 0) & (levels <= 15)).all(dim=1)
    mask[mask.clone()] = whole
    return mask, d[mask], levels[whole]


def _rounded(values: torch.Tensor, down: bool) -> torch.Tensor:
    """float32 -> the nearest float16 at or below (`down`) / at or above each value."""
    half = values.half()
    wrong = half.float() > values if down else half.float() < values
    return torch.where(wrong, torch.nextafter(half, torch.full_like(half, float("-inf") if down else float("inf"))), half)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q: [N, Kp] uint8 in 0..15, in k order -> [N, Kp / 2] bytes in BLOCK_ORDER."""
    n, kp = q.shape
    register = torch.empty_like(q).view(n, kp // BLOCK, BLOCK)
    register[..., BLOCK_ORDER.to(q.device)] = q.view(n, kp // BLOCK, BLOCK)
    return (register[..., :32] | (register[..., 32:] << 4)).reshape(n, kp // 2).contiguous()


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """packed: [N, Kp / 2] -> q [N, Kp] uint8 in k order."""
    n = packed.shape[0]
    blocks = packed.view(n, -1, 32)
    register = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [N, Kp / 64, 64]
    return register[..., BLOCK_ORDER.to(packed.device)].reshape(n, -1)
