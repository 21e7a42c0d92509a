"""Which kernel runs each linear layer and the attention, chosen on this host by measurement.

At engine start every distinct weight (shape and format) is timed with each candidate kernel for
each row-count bucket (1, 2-8, 9-64, more), and the fastest is kept; the choices are cached per CPU
model, torch version, native build and thread count in the pdserve cache folder, so the next start
on the same host measures nothing. The model calls one seam, `plan.linear(x, weight, bias)`.

Why measure instead of a rule: the same kernel wins by 2x on one CPU and loses by 2x on another
(bf16 `torch.mv` beat `F.linear` on an AMX Xeon and ran at half its speed on a Zen 4 EPYC).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from types import ModuleType

import torch

from services.attention import DecodeKernel, PrefillKernel, torch_decode_attention
from services.cache_folder import cache_root
from services.engine_config import KERNEL_MODES
from services.int4_weight import Int4Weight
from services.kernels import attention_choice
from services.kernels import native as native_build
from services.kernels.choice_cache import ChoiceCache
from services.kernels.cold_cache import ColdCache
from services.kernels.dequant_buffer import DEQUANT_BUFFER
from services.kernels.linear_candidates import LinearFn, candidates
from services.kernels.onednn_packs import fits
from services.kernels.weight_layouts import (
    Preference,
    from_panels_alone,
    int8_panels_beside_rows,
    keep_chosen_copies,
    panels_for_prefill_alone,
    preference,
    reads_panels,
    reads_three_layouts,
)
from services.quantized_weight import Int8Weight
from services.w4a8_weight import W4A8Weight

log = logging.getLogger(__name__)

BUCKETS = ("1", "2-8", "9-64", "65+")
PROBE_ROWS = (1, 4, 32, 128)  # the row count each bucket is timed at
MAX_ROWS = (1, 8, 64, 1 << 62)
TIMING = 7  # how candidates are timed (_fastest, its preferences, cold_cache.py, the panel copies' pages); a change re-times all


def bucket_of(rows: int) -> int:
    return 0 if rows == 1 else 1 if rows <= 8 else 2 if rows <= 64 else 3


def weight_key(weight: torch.Tensor | Int8Weight | Int4Weight) -> tuple:
    if isinstance(weight, Int8Weight):
        return (*weight.shape, "w8a8" if weight.dynamic_activations else "int8")
    if isinstance(weight, Int4Weight):  # W4A8Weight first: it is an Int4Weight in its own layout
        return (*weight.shape, "w4a8" if isinstance(weight, W4A8Weight) else "int4")
    return (*weight.shape, str(weight.dtype).removeprefix("torch."))


@dataclass
class KernelPlan:
    """The chosen kernel per weight key and bucket, and the decode and prefill attention's."""

    linear_choices: dict[tuple, tuple[str, ...]]  # weight_key -> a candidate name per bucket
    attention_choice: str  # "torch" | "native"
    native: ModuleType | None
    device: torch.device
    packed_bytes: int = 0  # copies kept beside their weights (onednn_packs.py, int4_panels.py)
    prefill_choice: str = "torch"  # "torch" | "native"
    summary: str = ""
    _table: dict[tuple, tuple[LinearFn, ...]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for key, names in self.linear_choices.items():
            self._table[key] = tuple(self._fn(key, names[b], b) for b in range(len(BUCKETS)))

    def _fn(self, key: tuple, name: str, bucket: int) -> LinearFn:
        return candidates(key[-1], self.device.type == "cpu", key[1], MAX_ROWS[bucket], self.native, packed=True)[name]

    def linear(self, x: torch.Tensor, weight: torch.Tensor | Int8Weight | Int4Weight, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        """y = x @ weight^T (+ bias); x: [M, K], weight [N, K] (any format) -> [M, N]."""
        return self._table[weight_key(weight)][bucket_of(x.shape[0])](x, weight, bias)

    def reads_rows(self, weight: torch.Tensor | Int8Weight | Int4Weight) -> bool:
        """Whether any kernel chosen for this weight reads its own layout (else only its copies: panels, oneDNN's)."""
        return not all(reads_panels(n) or n == "onednn.packed" for n in self.linear_choices[weight_key(weight)])

    def chosen(self, weight: torch.Tensor | Int8Weight | Int4Weight, bucket: int) -> tuple[str, LinearFn]:
        """The candidate `linear` runs for `weight` in row bucket `bucket`: its name and its function."""
        key = weight_key(weight)
        return self.linear_choices[key][bucket], self._table[key][bucket]

    @property
    def decode_attention(self) -> DecodeKernel:
        if self.attention_choice == "native":
            return attention_choice.native_decode(self.native)
        return torch_decode_attention

    @property
    def prefill_attention(self) -> PrefillKernel | None:
        """The native prefill kernel where it was chosen; None: paged_attention's SDPA path."""
        return attention_choice.native_prefill(self.native) if self.prefill_choice == "native" else None

    def describe(self) -> dict[str, object]:
        """For stats() and logs: the native build's state and every choice."""
        return {"native": self.native is not None, "attention": self.attention_choice,
                "prefill_attention": self.prefill_choice, "packed_bytes": self.packed_bytes,
                "linear": {"x".join(map(str, k[:-1])) + " " + k[-1]: dict(zip(BUCKETS, v))
                           for k, v in self.linear_choices.items()}}

    @classmethod
    def choose(cls, weights: list[torch.Tensor | Int8Weight | Int4Weight], attention_shape: tuple[int, int, int],
               dtype: torch.dtype, device: torch.device, mode: str = "auto") -> KernelPlan:
        """Measure (or read from the cache) the fastest kernel for each distinct weight and bucket.

        attention_shape: (query heads, kv heads, head dim) of the attention.
        """
        if mode not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
        native = native_build.load() if device.type == "cpu" and mode != "torch" else None
        cache = ChoiceCache.open(native, cache_root() / "kernels" / "choices.json", TIMING)
        started, cpu_started, measured = time.perf_counter(), time.process_time(), 0
        dense = {id(w): w for w in weights if isinstance(w, torch.Tensor)}
        # the weights a panel copy can serve: int4 (not W4A8Weight: its own kernel reads panels) and weight-only int8
        quantized = {id(w): w for w in weights
                     if type(w) is Int4Weight or (type(w) is Int8Weight and not w.dynamic_activations)}
        # oneDNN's packed copies and the panels are a second copy of a weight: offered only where all would fit
        packed = (device.type == "cpu" and mode != "native"
                  and fits(sum(w.nbytes for w in (*dense.values(), *quantized.values()))))
        choices: dict[tuple, tuple[str, ...]] = {}
        cold = ColdCache.for_weights(weights, device, getattr(native, "flush_cache_lines", None))

        def choose_bucket(weight: torch.Tensor | Int8Weight | Int4Weight, b: int,
                          offered: Callable[[str], bool] = lambda name: True) -> str:
            nonlocal measured
            key = weight_key(weight)
            # dequant.panels is dequant.linear's product bit for bit: not timed (a tie would keep a copy for prefill
            # alone), but put in its place where the rows can go (from_panels_alone)
            found = {name: fn for name, fn in candidates(key[-1], device.type == "cpu", weight.shape[1], MAX_ROWS[b],
                                                         native, packed, compute=dtype).items()
                     if offered(name) and name != "dequant.panels"}
            if mode == "native":  # one fixed kernel, nothing timed: every engine of a run computes alike
                # the native kernel where it runs (few rows), else w4a8's or w8a8's own product (every row
                # count), else the first (torch.linear / dequant.linear)
                name = next((n for n in ("native", "native.w4a8", "native.w8a8", "int8.dynamic") if n in found),
                            next(iter(found)))
                found = {name: found[name]}
            entry = f"linear {'x'.join(map(str, key[:-1]))} {key[-1]} rows {BUCKETS[b]} among {','.join(sorted(found))}"
            name = cache.get(entry, found)
            if name is None:
                rows = PROBE_ROWS[b]
                x = torch.randn(rows, weight.shape[1], device=device).to(dtype)
                # few rows read W from memory in the engine (cold): time them so; many rows are compute-bound
                timed_cold = cold is not None and rows <= 64
                name = _fastest({n: partial(f, x, weight, None) for n, f in found.items()}, device, rows,
                                partial(cold.evict, weight) if timed_cold else None,
                                cold.reread if timed_cold else None, prefer=preference(key, rows))
                measured += len(found) > 1 and cache.put(entry, name)
            return name

        for weight in weights:
            if weight_key(weight) in choices:
                continue
            names = [choose_bucket(weight, b) for b in range(len(BUCKETS))]
            if reads_three_layouts(names):  # rows, oneDNN's copy and the panels: the panels' buckets chosen again
                names = [choose_bucket(weight, b, lambda n: not reads_panels(n)) if reads_panels(name) else name
                         for b, name in enumerate(names)]
            elif int8_panels_beside_rows(weight_key(weight), names):  # int8's rows stay: the copy for one row, prefill
                names = [choose_bucket(weight, b, lambda n: not reads_panels(n)) if b in (1, 2) and reads_panels(name)
                         else name for b, name in enumerate(names)]
            if panels_for_prefill_alone(weight_key(weight), names):  # no copy held for a few percent of prefill
                names[-1] = choose_bucket(weight, len(BUCKETS) - 1, lambda n: not reads_panels(n))
            choices[weight_key(weight)] = tuple(names)
        if (device.type == "cpu" and any(key[-1] == "w8a8" for key in choices) and not native_build.int8_dot_products()
                and not hasattr(native, "w8a8_linear")):
            log.warning("w8a8 on a CPU without int8 dot-product instructions (VNNI, AMX) and without the native w8a8 "
                        "kernel (AVX2 or AVX512-VNNI builds): every product runs torch's reference int8 loop (measured "
                        "on an AVX2-only AMD EPYC: 11 s for one 1,024-row 16384 x 2048 product, 23x float32's); "
                        "--quantization int8 keeps the memory saving at full speed")
        if device.type == "cpu" and any(key[-1] == "w4a8" for key in choices) and not hasattr(native, "w4a8_linear"):
            log.warning("w4a8 without its int8 dot-product kernel (built on CPUs with AVX512-VNNI or AVX2): every "
                        "product rounds x and dequantizes its weight in torch's operators; --quantization int4 keeps "
                        "the memory saving at full speed")
        attention = prefill = "torch"
        if native is not None:
            attention, prefill, timed = attention_choice.choose(native, cache, attention_shape, dtype, mode, _fastest)
            measured += timed
        # Timings taken while other processes held our cores say little: use them for this run only.
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        busy = device.type == "cpu" and cpu < 0.7 * wall * torch.get_num_threads()
        if not busy:
            cache.save()
        DEQUANT_BUFFER.release()  # timing's buffers (float32 candidates' among them): in use, each thread makes its own
        choices = {key: from_panels_alone(key, names, native) for key, names in choices.items()}
        plan = cls(choices, attention, native, device, prefill_choice=prefill,
                   packed_bytes=keep_chosen_copies(dense.values(), quantized.values(),
                                                   lambda w: choices[weight_key(w)]))
        where = (f"measured {measured} in {wall:.1f} s{', host busy: not cached' if busy else ''}" if measured
                 else "from the cache")
        plan.summary = (f"kernels on {native_build.cpu_model()}, {torch.get_num_threads()} threads, mode {mode} "
                        f"({where}): native {'built' if native else 'off'}; decode attention {attention}; prefill attention {prefill}; "
                        f"copies in kernels' layouts {plan.packed_bytes / 2**20:.0f} MiB; linear "
                        + "; ".join(f"{k}: {'/'.join(v.values())}" for k, v in plan.describe()["linear"].items()))
        return plan


def _fastest(fns: dict[str, Callable[[], object]], device: torch.device, rows: int,
             before: Callable[[], object] | None = None, after: Callable[[], object] | None = None,
             prefer: Preference | None = None) -> str:
    """The name of the fastest of `fns`, best of interleaved rounds; `before` runs, untimed, ahead of each call,
    `after` right after it, timed with it (cold_cache.py: what the call evicted, read again). The fastest of those
    `prefer` names wins if it is within its margin of the fastest of all (weight_layouts.py)."""
    if len(fns) == 1:
        return next(iter(fns))
    best = dict.fromkeys(fns, float("inf"))
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # warm-up: first calls allocate and pack
        for round_ in range(3 if rows > 64 else 7):  # interleaved, so a noisy moment hits every candidate
            for name, fn in fns.items():
                if before is not None:
                    before()
                start = time.perf_counter()
                fn()
                if after is not None:
                    after()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                best[name] = min(best[name], time.perf_counter() - start)
            if round_ == 0:  # a candidate 3x slower than the best will not win: stop timing it
                fns = {n: f for n, f in fns.items() if best[n] <= 3 * min(best.values())}
    fastest = min(best, key=best.get)
    preferred = [n for n in best if prefer is not None and prefer.names(n) and best[n] <= prefer.margin * best[fastest]]
    return min(preferred, key=best.get) if preferred else fastest
