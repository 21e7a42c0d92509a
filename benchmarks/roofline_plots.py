"""The three PNGs of `pdserve roofline` (see benchmarks/roofline_command.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.plots import pyplot, save


def write_plots(report: dict, out: Path) -> list[Path]:
    title = f"{Path(report['model']).name} ({report['dtype']}), {report['environment']['cpu']}"
    return [prefill_vs_length(report, out / "prefill_vs_length.png", title),
            batching(report, out / "batching.png", title),
            disaggregation(report, out / "disaggregation.png", title)]


def prefill_vs_length(report: dict, path: Path, title: str) -> Path:
    plt = pyplot()
    section = report["prefill_vs_length"]
    fit, points = section["fit"], section["points"]
    lengths = np.array([p["size"] for p in points], dtype=float)
    grid = np.linspace(0, lengths.max() * 1.05, 100)
    a, b, c = fit["intercept_s"], fit["linear_s_per_token"], fit["quadratic_s_per_token2"]
    fig, (ax, mfu) = plt.subplots(1, 2, figsize=(12, 4))
    ax.plot(lengths, [p["seconds"] for p in points], "o", label="measured prefill step")
    ax.plot(grid, a + b * grid + c * grid**2, label="fit a + bL + cL²")
    ax.plot(grid, a + b * grid, "--", label="its linear part (matmuls)")
    ax.plot(grid, c * grid**2, ":", label="its quadratic part (attention)")
    crossover = fit["attention_crossover_tokens"]
    if crossover is not None and crossover < grid[-1]:
        ax.axvline(crossover, color="gray", alpha=0.5, label=f"bL = cL² at L={crossover:,.0f}")
    ax.set_xlabel("prompt length L (tokens)")
    ax.set_ylabel("prefill step (s)")
    ax.legend(fontsize=8)
    peak = report["ceilings"]["flops_per_second"]
    mfu.plot(lengths, [p["flops_per_second"] / peak for p in points], "o-")
    mfu.set_xlabel("prompt length L (tokens)")
    mfu.set_ylabel("FLOPs / step time / matmul ceiling (MFU)")
    for axis in (ax, mfu):
        axis.grid(alpha=0.3)
    fig.suptitle(f"1. prefill cost against prompt length — {title}", fontsize=10)
    return save(fig, path)


def batching(report: dict, path: Path, title: str) -> Path:
    plt = pyplot()
    section, peaks = report["batching"], report["ceilings"]
    flops_peak, bandwidth = peaks["flops_per_second"], peaks["bytes_per_second"]
    fig, (ax, roof) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, points, style in (("decode step", section["decode"], "o-"),
                                (f"prefill step ({section['prefill_len']}-token prompts)", section["prefill"], "s-")):
        sizes = [p["size"] for p in points]
        ax.plot(sizes, [p["seconds"] * 1e3 for p in points], style, label=name)
        bound = [max(p["flops"] / flops_peak, p["bytes"] / bandwidth) * 1e3 for p in points]
        ax.plot(sizes, bound, ":", color=ax.lines[-1].get_color(), label=f"{name}: ceiling bound")
        roof.plot([p["arithmetic_intensity"] for p in points], [p["flops_per_second"] / 1e9 for p in points], style,
                  label=name)
        for p in points:
            roof.annotate(str(p["size"]), (p["arithmetic_intensity"], p["flops_per_second"] / 1e9), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences in the step)")
    ax.set_ylabel("step time (ms)")
    ax.legend(fontsize=7)
    intensities = np.logspace(-1, 4, 200)
    roof.plot(intensities, np.minimum(flops_peak, intensities * bandwidth) / 1e9, "k-", label="roofline")
    ridge = peaks["ridge_flops_per_byte"]
    roof.axvline(ridge, color="gray", linestyle="--", label=f"ridge {ridge:.1f} FLOP/byte")
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlabel("arithmetic intensity (FLOPs per byte read)")
    roof.set_ylabel("achieved GFLOP/s")
    roof.legend(fontsize=7)
    for axis in (ax, roof):
        axis.grid(alpha=0.3, which="both")
    fig.suptitle(f"2. batching: decode is bandwidth-bound, prefill compute-bound — {title}", fontsize=10)
    return save(fig, path)


def disaggregation(report: dict, path: Path, title: str) -> Path:
    plt = pyplot()
    section = report["disaggregation"]
    rows = section["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(x - 0.27, [r["colocated_s"] * 1e3 for r in rows], width=0.27, label="colocated (whole prompt in one step)")
    ax.bar(x, [r["chunked_s"] * 1e3 for r in rows], width=0.27,
           label=f"colocated, chunked prefill ({section['chunk_size']}): per step")
    ax.bar(x + 0.27, [r["disaggregated_s"] * 1e3 for r in rows], width=0.27, label="disaggregated")
    ax.set_xticks(x, [str(r["prompt_len"]) for r in rows])
    ax.set_xlabel("length of the arriving prompt (tokens)")
    ax.set_ylabel(f"a running stream's token gap (ms), decode batch {section['decode_batch']}")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.suptitle(f"3. what disaggregation buys — {title}", fontsize=10)
    return save(fig, path)
