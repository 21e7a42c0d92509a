"""A decode step's decoder layers as one native call (decode_chain.cpp) instead of the forward's Python loop.

Between two weight streams the forward's loop runs ~12 torch operators a layer from Python; on an AMD EPYC Zen 4
(2 threads, bf16 `1b`) that cost ~5 ms of a ~60 ms step: the calls themselves, and the caches refilling with
Python's and torch's code and data after every product had streamed a weight through them. The chain runs the same
kernels in the same order from C++, so its values are the forward's bit for bit: each product is the kernel the
plan chose for the step's row count, called directly where it is a native one (decode_chain.h lists which) and
through the plan's own Python function otherwise (oneDNN, torch, w8a8's panels).

Used for decode-only steps (one new token per sequence) on a CPU with the native build and the native decode
attention chosen, without tensor parallelism; elsewhere the forward's loop runs. One chain per row bucket, built on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.attention import AttentionMetadata
from services.int4_weight import Int4Weight
from services.kernels.bf16_panels import BF16_PANELS
from services.kernels.int4_panels import INT4_PANELS
from services.kernels.int8_panels import INT8_PANELS
from services.kernels.kernel_plan import bucket_of
from services.kernels.stream_variants import PANEL_VARIANTS, SKINNY_VARIANTS, X16_VARIANTS, parts_name
from services.quantized_weight import Int8Weight
from services.w4a8_weight import W4A8Weight

if TYPE_CHECKING:
    from services.model import LlamaModel


def _parts_options(name: str, kernel: str, variants: tuple = X16_VARIANTS) -> list[int] | None:
    """[streams, non_temporal] of candidate `name` if it is one of `kernel`'s `variants`, else None."""
    return next(([s, int(nt)] for s, nt in variants if parts_name(kernel, s, nt) == name), None)


def chain_product(name: str, weight: torch.Tensor | Int8Weight | Int4Weight) -> tuple[str, list, list[int]]:
    """How decode_chain.cpp runs candidate `name` (linear_candidates.py) on `weight` itself: (kernel, tensors,
    options) of the native kernel that candidate calls, or ("call", [], []) where only its Python function can."""
    if isinstance(weight, W4A8Weight):  # its native kernel rounds x itself; the definition's torch operators: called
        if name == "native.w4a8":
            return "w4a8", [weight.packed, weight.scale, weight.low], [weight.out_features]
        return "call", [], []
    if isinstance(weight, Int4Weight):
        for kernel, candidate in (("int4_x16", "native.x16"), ("int4", "native")):
            if (options := _parts_options(name, candidate)) is not None:
                return kernel, [weight.packed, weight.scale, weight.low], options
        if (options := _parts_options(name, "native.panels", PANEL_VARIANTS)) is not None:
            return "int4_panels", list(INT4_PANELS.copy(weight)), [weight.shape[0], *options]
        return "call", [], []
    if isinstance(weight, Int8Weight) and weight.dynamic_activations:  # w8a8: each kernel rounds x itself
        if name == "native.w8a8":
            return "w8a8", [weight.qweight, weight.scale], []
        if (options := _parts_options(name, "native.w8a8.row")) is not None:
            return "w8a8_row", [weight.qweight, weight.scale], options
        return "call", [], []
    values, scale = (weight.qweight, weight.scale) if isinstance(weight, Int8Weight) else (weight, None)
    if (options := _parts_options(name, "native.panels", PANEL_VARIANTS)) is not None:
        copies, kind = (BF16_PANELS, "bf16_panels") if scale is None else (INT8_PANELS, "int8_panels")
        return kind, list(copies.copy(weight)), [weight.shape[0], *options]
    if name in SKINNY_VARIANTS:
        return "skinny", [values, scale], [int(v) for v in SKINNY_VARIANTS[name]]
    if scale is not None and (options := _parts_options(name, "native.x16")) is not None:
        return "int8_x16", [values, scale], options
    if scale is not None and name == "native.digits":
        return "int8_digits", [values, scale], []
    return "call", [], []


class DecodeChains:
    def __init__(self, model: LlamaModel) -> None:
        self.model = model
        self._chains: dict[int, object] = {}  # row bucket -> the native DecodeChain

    @classmethod
    def for_model(cls, model: LlamaModel) -> DecodeChains | None:
        """The model's chains, or None where its decode steps must take the forward's loop (see the module doc)."""
        native = model.plan.native
        usable = (native is not None and hasattr(native, "DecodeChain") and model.embed.device.type == "cpu"
                  and model.group is None and model.plan.attention_choice == "native")
        return cls(model) if usable else None

    def run(self, h: torch.Tensor, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
            kv_cache: torch.Tensor) -> torch.Tensor:
        """Every layer of a decode step: h [N, D] the residual stream (updated in place), x [N, D] its normalized
        copy; rope: the forward's cos, sin_signed [N, 1, Dh]; kv_cache [L, 2, S, K, Dh]. Returns the final x."""
        bucket = bucket_of(h.shape[0])
        chain = self._chains.get(bucket) or self._chains.setdefault(bucket, self._build(bucket))
        cos, sin_signed = rope
        return chain.run(h, x, kv_cache, meta.slot_mapping, meta.block_tables, meta.context_lens_tensor,
                         meta.block_size, cos.squeeze(1), sin_signed.squeeze(1))

    def _build(self, bucket: int):
        model, native = self.model, self.model.plan.native
        products = []
        for layer in model.layers:
            for weight, bias in ((layer.qkv, layer.qkv_bias), (layer.o, None), (layer.gate_up, None),
                                 (layer.down, None)):
                name, fn = model.plan.chosen(weight, bucket)
                kernel, tensors, options = chain_product(name, weight)
                call = None if kernel != "call" else (lambda x, fn=fn, weight=weight, bias=bias: fn(x, weight, bias))
                products.append(native.ChainProduct(kernel, tensors, bias, options, call))
        c = model.config
        return native.DecodeChain(products, [layer.post_norm for layer in model.layers], model._next_norms,
                                  [layer.q_norm for layer in model.layers], [layer.k_norm for layer in model.layers],
                                  model.num_heads, model.num_kv_heads, c.head_dim, c.rms_norm_eps, model.scale)
