"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a paged KV pool.

Legend: N tokens in the flat batch, D hidden size, H query heads, K kv heads, Dh head dim,
F intermediate size, V vocab size, L layers, S pool slots.
Weights arrive with Hugging Face names; q/k/v and gate/up are fused at load, so each layer is
four matrix products, each through the kernel plan's `linear` (the fastest kernel measured on this
host for that weight and row count); with `quantization` the four and lm_head are weight-only
quantized (int4: lm_head in int8; in a 4-bit file each matrix keeps its file's bits, quantized_weight.FileFormats;
the embedding lookup, norms and KV stay in the compute dtype).
A decode step on a CPU with the native build runs its layers in one native call over the same kernels
(services/kernels/decode_chain.py: the same logits, without Python between the products).
With a tensor-parallel `group`, the weights arrive already sharded (services/tensor_parallel_shards.py):
H and K are then this rank's heads, o and down are summed over the ranks (all-reduce), the embedding
rows are this rank's vocab slice (looked up, summed), and the logits are gathered on rank 0 only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.attention import AttentionMetadata, paged_attention
from services.checkpoint import PROJECTIONS
from services.int4_weight import Int4Weight
from services.kernels.bf16_panels import BF16_PANELS, ValuesDropped, without_values
from services.kernels.decode_chain import DecodeChains
from services.kernels.decoder_glue import DecoderGlue, rms_norm
from services.kernels.int4_panels import INT4_PANELS
from services.kernels.int8_panels import INT8_PANELS
from services.kernels.kernel_plan import KernelPlan
from services.kernels.onednn_packs import ONEDNN_PACKS
from services.model_config import ModelConfig
from services.quantized_weight import FileFormats, Int8Weight, QuantizedWeight
from services.rotary import RotaryEmbedding
from services.tensor_parallel import RankGroup
from services.tensor_parallel_shards import ShardLayout
from services.weight_arena import HugePageArena

# Not cuDNN's attention: it builds a plan per shape on the host (2.3 ms a call on an H200 host), and
# a decode step's context grows by one every step, so every call missed its cache (measured:
# benchmarks/step_profile.py, 1b, 48 ms steps of which 37 ms were planning).
GPU_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(slots=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor | QuantizedWeight  # [(H + 2K) * Dh, D]
    qkv_bias: torch.Tensor | None  # [(H + 2K) * Dh]
    q_norm: torch.Tensor | None  # [Dh]
    k_norm: torch.Tensor | None  # [Dh]
    o: torch.Tensor | QuantizedWeight  # [D, H * Dh]
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor | QuantizedWeight  # [2F, D]
    down: torch.Tensor | QuantizedWeight  # [D, F]


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 device: torch.device, quantization: str | None = None, kernels: str = "auto",
                 shard: ShardLayout | None = None, group: RankGroup | None = None) -> None:
        self.config = config
        self.shard, self.group = shard, group
        self.num_heads = shard.num_heads if shard else config.num_heads  # this rank's
        self.num_kv_heads = shard.num_kv_heads if shard else config.num_kv_heads
        self.quantization = quantization
        self.scale = config.head_dim**-0.5
        self.embed = weights.pop("model.embed_tokens.weight")  # [V, D]
        self.final_norm = weights["model.norm.weight"]
        # int4 keeps the output projection in int8, as llama.cpp's 4-bit files keep theirs in 6-8 bits: on
        # SmolLM2-135M an int4 lm_head alone moved the text's logprobs by 0.30 (int8: 0.03; docs/engine.md)
        head_quantization = "int8" if quantization in ("int4", "w4a8") else quantization
        self.formats = FileFormats([w for name, w in weights.items() if name.endswith(PROJECTIONS)], quantization)
        head = self.embed if config.tie_word_embeddings else weights.pop("lm_head.weight")
        self.lm_head = self.formats.quantize(head, head_quantization)
        self.layers = [self._layer(weights, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.rotary = RotaryEmbedding(config, max_positions, device)
        self._into_huge_pages()
        matrices = [self.lm_head] + [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.plan = KernelPlan.choose(matrices, (self.num_heads, self.num_kv_heads, config.head_dim),
                                      self.embed.dtype, device, kernels)
        self._drop_unread_layouts()
        self.decode_kernel = self.plan.decode_attention
        self.prefill_kernel = self.plan.prefill_attention  # None: SDPA (always on a GPU)
        self.glue = DecoderGlue(self.plan.native)  # residual adds, norms, rotary: one native pass each on a CPU
        self._next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        # decode steps' layers in one native call where the host has it (kernels/decode_chain.py); None: the loop
        self.chains = DecodeChains.for_model(self)

    @property
    def kernel_summary(self) -> str:
        """The plan's choices, and whether decode steps run as one native call: for the start-up log and stats()."""
        kept = f"; {self.formats.summary}" if self.formats.summary else ""
        return self.plan.summary + kept + ("; decode steps: one native call (decode_chain)" if self.chains else "")

    def _into_huge_pages(self) -> None:
        """Every matrix a decode step streams, moved into 2 MB pages (services/weight_arena.py)."""
        self._arena = None
        if self.embed.device.type != "cpu":
            return
        owners = [(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        owners.append((self, "lm_head"))

        def data(weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:  # the bytes each step streams
            return (weight.qweight if isinstance(weight, Int8Weight) else weight.packed if isinstance(weight, Int4Weight)
                    else weight)

        def placed(weight: torch.Tensor | QuantizedWeight, moved: torch.Tensor) -> torch.Tensor | QuantizedWeight:
            if isinstance(weight, Int8Weight):
                return dataclasses.replace(weight, qweight=moved)
            return weight.with_packed(moved) if isinstance(weight, Int4Weight) else moved

        arena = self._arena = HugePageArena.create(sum(HugePageArena.size_of(data(getattr(o, n))) for o, n in owners))
        if arena is None:
            return
        tied = self.embed is self.lm_head
        for owner, name in owners:  # one at a time: each original is freed once moved
            weight = getattr(owner, name)
            moved = arena.copy(data(weight))
            setattr(owner, name, placed(weight, moved))
        if tied:
            self.embed = self.lm_head  # still one tensor: the lookup table is the output projection

    def _drop_unread_layouts(self) -> None:
        """Free the own layout of every weight whose chosen kernels all read its copies (kernel_plan.py: int4's and
        weight-only int8's panels; a dense weight's panels or oneDNN's packed copy): an int4 weight then takes 0.625
        bytes a value, not twice that, an int8 one 1 byte, not 2, a bf16 one read only by the panel kernel 2 bytes,
        not 4. A tied output projection is also the embedding's lookup table: it goes only where its copy is the
        panels, from which `_embed` gathers the rows."""
        owners = [(layer, name) for layer in self.layers for name in ("qkv", "o", "gate_up", "down")]
        tied = self.lm_head is self.embed
        if not tied or BF16_PANELS.holds(self.lm_head):
            owners.append((self, "lm_head"))
        for owner, name in owners:
            weight = getattr(owner, name)
            if type(weight) is Int4Weight and not weight.rows_dropped and not self.plan.reads_rows(weight):
                dropped, bytes_ = weight.without_rows(), weight.packed
                INT4_PANELS.rekey(weight, dropped)
            elif type(weight) is Int8Weight and INT8_PANELS.holds(weight) and not self.plan.reads_rows(weight):
                dropped, bytes_ = weight.without_rows(), weight.qweight
                INT8_PANELS.rekey(weight, dropped)
            elif (type(weight) is torch.Tensor and weight.device.type == "cpu" and not self.plan.reads_rows(weight)
                  and (BF16_PANELS.holds(weight) or ONEDNN_PACKS.holds(weight))):
                dropped, bytes_ = without_values(weight), weight
                for copies in (BF16_PANELS, ONEDNN_PACKS):
                    if copies.holds(weight):
                        copies.rekey(weight, dropped)
            else:
                continue
            setattr(owner, name, dropped)
            if tied and owner is self:
                self.embed = dropped
            if self._arena is not None:
                self._arena.release(bytes_)  # its pages: the tensor's bytes live as long as the arena

    def _layer(self, w: dict[str, torch.Tensor], p: str) -> DecoderLayerWeights:
        attn = p + "self_attn."
        quantize = functools.partial(self.formats.quantize, quantization=self.quantization)
        qkv = quantize(torch.cat([w.pop(attn + f"{n}_proj.weight") for n in "qkv"]))
        bias = torch.cat([w.pop(attn + f"{n}_proj.bias") for n in "qkv"]) if self.config.attention_bias else None
        return DecoderLayerWeights(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=qkv,
            qkv_bias=bias,
            q_norm=w.get(attn + "q_norm.weight") if self.config.qk_norm else None,
            k_norm=w.get(attn + "k_norm.weight") if self.config.qk_norm else None,
            o=quantize(w.pop(attn + "o_proj.weight")),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=quantize(torch.cat([w.pop(p + "mlp.gate_proj.weight"), w.pop(p + "mlp.up_proj.weight")])),
            down=quantize(w.pop(p + "mlp.down_proj.weight")),
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logit_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [N]; kv_cache: [L, 2, S, K, Dh]; logit_indices: [M] rows to project.

        Returns float32 logits [M, V] (None on a tensor-parallel rank other than 0).
        """
        eps = self.config.rms_norm_eps
        # h: the residual stream [N, D]; x: its normalised copy, the next block's input [N, D]. Each
        # residual add is fused with the norm that reads its sum (the next layer's input norm, or the final one).
        h, x = self.glue.residual_norm(self._embed(input_ids), None, self.layers[0].input_norm, eps)
        rope = self.rotary.tables(positions, h.dtype)  # shared by every layer
        if self.chains is not None and meta.decode_mask is not None:  # the same kernels, called from C++
            x = self.chains.run(h, x, rope, meta, kv_cache)
        else:
            with sdpa_kernel(GPU_ATTENTION_BACKENDS) if h.is_cuda else contextlib.nullcontext():
                for layer, layer_cache, next_norm in zip(self.layers, kv_cache, self._next_norms):
                    h, x = self.glue.residual_norm(h, self._attention(layer, x, rope, meta, layer_cache),
                                                   layer.post_norm, eps)
                    h, x = self.glue.residual_norm(h, self._mlp(layer, x), next_norm, eps)
        logits = self.plan.linear(x[logit_indices], self.lm_head).float()  # [M, V / size]
        return logits if self.group is None else self.group.gather_rows(logits)

    def _mlp(self, layer: DecoderLayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.plan.linear(x, layer.gate_up)  # [N, 2F]: gate | up
        return self._reduce(self.plan.linear(self.glue.silu_mul(gate_up), layer.down))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self._embedding_rows(input_ids)
        local = input_ids - self.shard.vocab_start  # rows of this rank's vocab slice; others are zero
        mine = (local >= 0) & (local < self.shard.vocab_size)
        h = self._embedding_rows(local.clamp(0, self.shard.vocab_size - 1)) * mine[:, None].to(self.embed.dtype)
        return self.group.all_reduce(h)

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the embedding table: from its panel copy where its values were dropped (tied to the output
        projection, read only through the panels)."""
        return BF16_PANELS.rows(self.embed, ids) if type(self.embed) is ValuesDropped else self.embed[ids]

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel product's partial sums, summed over the ranks (in place)."""
        return x if self.group is None else self.group.all_reduce(x)

    def _attention(self, layer: DecoderLayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   meta: AttentionMetadata, layer_cache: torch.Tensor) -> torch.Tensor:
        c = self.config
        num_tokens, h, kv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.plan.linear(x, layer.qkv, layer.qkv_bias).view(num_tokens, h + 2 * kv, c.head_dim)  # heads: q | k | v
        v = qkv[:, h + kv :]
        if layer.q_norm is None:  # q and k are adjacent heads: rotate them in one pass
            qk = self.glue.rotate(qkv[:, : h + kv], *rope)
            q, k = qk[:, :h], qk[:, h:]
        else:  # (Qwen3) each normalised with its own weight first
            q = self.glue.rotate(rms_norm(qkv[:, :h], layer.q_norm, c.rms_norm_eps), *rope)
            k = self.glue.rotate(rms_norm(qkv[:, h : h + kv], layer.k_norm, c.rms_norm_eps), *rope)
        o = paged_attention(q, k, v, layer_cache, meta, self.scale, self.decode_kernel,
                            self.prefill_kernel)  # [N, H, Dh]
        return self._reduce(self.plan.linear(o.reshape(num_tokens, -1), layer.o))
