"""The native CPU kernels (the C++ files beside this one), compiled on this host on first use with
its own instruction set (`-march=native`) and cached under the pdserve cache folder, keyed by the
sources, the flags, torch's version and the CPU, so later starts load them in milliseconds.

Compiling on the host, not at packaging time, is what lets one source use AVX-512 where the CPU has
it and stay correct where it does not. `make` builds them once at install (`python -m
services.kernels.native`), so a first request never waits for the compiler. Where nothing can be
compiled (no compiler, no ninja) the engine keeps torch's kernels, saying so in one log line.
`PDSERVE_NATIVE_MARCH=znver3` (any -march target the CPU can run) builds an older CPU's paths instead, apart.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from services.cache_folder import cache_root

log = logging.getLogger(__name__)

SOURCES = ("bindings.cpp", "skinny_linear.cpp", "paged_decode_attention.cpp", "int4_linear.cpp",
           "int4_dequantize.cpp", "int4_tiled_linear.cpp", "int4_x16_linear.cpp", "int8_x16_linear.cpp",
           "prefill_attention.cpp", "decoder_glue.cpp", "tiled_linear.cpp", "pair_tiled_linear.cpp",
           "w4a8_linear.cpp", "w4a8_avx2_linear.cpp", "w8a8_linear.cpp", "w8a8_matmul_parts.cpp",
           "decode_chain.cpp", "amx_linear.cpp", "argmax_rows.cpp", "int4_panel_linear.cpp", "int4_panel_dequantize.cpp",
           "bf16_panel_linear.cpp", "int8_panel_linear.cpp", "amx_w8a8_linear.cpp", "int8_digits_linear.cpp",
           "cache_lines.cpp", "int8_panel_bf16_linear.cpp", "panel_tiled_linear.cpp")
HEADERS = ("vec_load.h", "int4_block.h", "softmax_math.h", "pair_gemm.h", "x16_groups.h", "decode_blocks.h",
           "decode_runs.h", "decode_tokens.h", "decode_pairs.h", "w4a8_panels.h", "decode_chain.h", "thread_chunks.h",
           "glue_lanes.h", "row_rounding.h", "int8_dot_tiles.h", "int8_product_args.h", "x_digits.h",
           "w8a8_x_panels.h", "transpose16.h", "tile_state.h", "decode_tiles.h", "amx_rows.h", "prefill_tiles.h",
           "prefill_softmax.h", "rows_ahead.h", "tile_chunks.h", "skinny_rows.h", "int4_slot_x.h", "count_dispatch.h",
           "int4_panel_octets.h", "panel_rows.h", "pair_sources.h", "int8_panel_copy.h", "bf16_panel_dots.h")
DISABLE_ENV = "PDSERVE_NATIVE_KERNELS"  # "0": never compile or load them
# A -march target instead of the host's own ("native"): an older CPU's paths run and measured on a newer one (e.g.
# znver3 on an AVX-512 host builds the AVX2 kernels). A developer's knob: a target the CPU cannot run stops the
# process at its first unknown instruction.
MARCH_ENV = "PDSERVE_NATIVE_MARCH"


def cflags() -> tuple[str, ...]:
    """The compiler flags of the build (OpenMP: at::parallel_for runs on torch's own libgomp)."""
    march = os.environ.get(MARCH_ENV, "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", march):
        raise ValueError(f"{MARCH_ENV} must be a -march target such as native, znver3 or x86-64-v3, got {march!r}")
    return ("-O3", f"-march={march}", "-fopenmp")


def cpu_model() -> str:
    """The CPU's marketing name and generation ("AMD EPYC (family 23 model 49)", "Intel(R) Xeon(R) ...
    (family 6 model 143)") for logs, figures and cache keys: cloud hosts often name only the brand, and
    one "AMD EPYC" has been a Zen 2, a Zen 3 and a Zen 4, whose best kernels differ."""
    fields = _cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's lines of /proc/cpuinfo as {field: value}; {} where there is none."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def _cpu_flags() -> str:
    """The CPU's feature flags, space-separated ("fpu vme ... avx2 ..."); "" where unknown."""
    return _cpuinfo_fields().get("flags", "")


def int8_dot_products() -> bool:
    """Whether this CPU has int8 dot-product instructions (VNNI, AMX): without them torch's int8 x int8
    product, the only one w8a8 has on a CPU, is a reference loop (AMD EPYC Zen 3: 6 GFLOP/s)."""
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


def build_key() -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    # torch's folder too: the build's include paths name it, so two virtualenvs sharing the cache
    # (a checkout and its fresh clone) would otherwise rebuild each other's build on every load
    for part in (*cflags(), torch.__version__, os.path.dirname(torch.__file__), sys.version, cpu_model(), _cpu_flags()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


@contextmanager
def _builder(build_dir: Path) -> Iterator[None]:
    """Holds build_dir's lock: one process at a time builds or loads there. torch's own lock is a file
    (`lock`) that a killed build leaves behind, and every later load would wait on it forever; this one
    is an flock, released by the OS when its holder dies, so a `lock` file found while holding it is
    left over from a build that died, and is removed."""
    with open(build_dir / "build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a native kernel build that was killed", stale)
            stale.unlink()
        yield


@cache
def load() -> ModuleType | None:
    """The compiled module (`skinny_linear`, `paged_decode_attention`), or None where it cannot be had."""
    if os.environ.get(DISABLE_ENV) == "0":
        log.info("native kernels off (%s=0): torch's kernels only", DISABLE_ENV)
        return None
    from torch.utils import cpp_extension

    # The `ninja` package installs its binary beside this interpreter; a Ray worker or a
    # `.venv/bin/python` run without an activated venv does not have that folder on PATH.
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    key = build_key()  # ValueError for a bad PDSERVE_NATIVE_MARCH: said, not silently replaced
    build_dir = cache_root() / "kernels" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    try:
        with _builder(build_dir):  # concurrent first starts wait for one build
            return cpp_extension.load(name=f"pdserve_kernels_{key}", sources=[str(here / s) for s in SOURCES],
                                      extra_cflags=list(cflags()), extra_ldflags=["-fopenmp"],
                                      build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, no ninja, a compiler error: torch's kernels still work
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("native CPU kernels unavailable, using torch's (%s: %s)", type(exc).__name__, first_line[:200])
        return None


if __name__ == "__main__":  # the install step: build once, say where
    logging.basicConfig(level=logging.INFO)
    module = load()
    print(f"native kernels: {'built in ' + str(cache_root() / 'kernels' / build_key()) if module else 'unavailable'}")
