"""PNG figures of the bench, roofline and study commands (matplotlib, without a display)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LATENCIES = (("ttfts", "TTFT"), ("tpots", "TPOT"), ("itls", "ITL"), ("e2els", "E2E latency"))


def pyplot():
    """matplotlib's pyplot on the Agg backend, or a clear error naming the package to install."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the plots need matplotlib: pip install 'matplotlib>=3.8' (or drop --plot)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_samples(result: dict) -> dict[str, list[float]]:
    """Milliseconds per latency kind over the successful requests of a bench result."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    tpots = [(result["e2els"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1)
             for i in ok if result["output_lens"][i] > 1]
    return {"ttfts": [1e3 * result["ttfts"][i] for i in ok], "tpots": [1e3 * t for t in tpots],
            "itls": [1e3 * g for i in ok for g in result["itls"][i]], "e2els": [1e3 * result["e2els"][i] for i in ok]}


def latency_cdfs(results: dict[str, dict], path: Path, title: str) -> Path:
    """One panel per latency kind, one CDF line per labelled result."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for label, result in results.items():
        samples = latency_samples(result)
        for ax, (key, name) in zip(axes, LATENCIES):
            values = sorted(samples[key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
            ax.set_xlabel(f"{name} (ms)")
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def rate_sweep(results: Sequence[dict], path: Path, title: str) -> Path:
    """p50/p99 TTFT, TPOT, ITL and throughput/goodput against the request rate."""
    plt = pyplot()
    rates = [float(r["request_rate"]) for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, metric in zip(axes, ("ttft", "tpot", "itl")):
        for stat in ("median", "p99"):
            ax.plot(rates, [r[f"{stat}_{metric}_ms"] for r in results], marker="o", label=stat)
        ax.set_ylabel(f"{metric.upper()} (ms)")
    axes[3].plot(rates, [r["request_throughput"] for r in results], marker="o", label="throughput")
    if all(r["request_goodput"] is not None for r in results):
        axes[3].plot(rates, [r["request_goodput"] for r in results], marker="o", label="goodput")
    axes[3].set_ylabel("requests/s")
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def study_figure(results: dict[str, dict], tpot_slo_ms: float, path: Path, title: str) -> Path:
    """The study at a glance: ITL and TPOT CDFs per topology (the TPOT objective marked), and each
    topology's p99 ITL and goodput side by side."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, result in results.items():
        samples = latency_samples(result)
        for ax, key in zip(axes[:2], ("itls", "tpots")):
            values = sorted(samples[key])
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    axes[0].set_xlabel("inter-token latency (ms), every gap")
    axes[1].set_xlabel("TPOT (ms), per request")
    axes[1].axvline(tpot_slo_ms, color="gray", linestyle="--", label=f"objective {tpot_slo_ms:g} ms")
    for ax in axes[:2]:
        ax.set_xscale("log")
        ax.set_ylabel("cumulative fraction")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    names = list(results)
    positions = range(len(names))
    bars = axes[2]
    bars.bar([p - 0.2 for p in positions], [results[n]["request_goodput"] for n in names], width=0.4,
             label="goodput (req/s)", color="tab:green")
    bars.set_ylabel("goodput (req/s)")
    itl = bars.twinx()
    itl.bar([p + 0.2 for p in positions], [results[n]["p99_itl_ms"] for n in names], width=0.4,
            label="p99 ITL (ms)", color="tab:red")
    itl.set_ylabel("p99 ITL (ms)")
    bars.set_xticks(list(positions), [n.replace(", ", ",\n") for n in names], fontsize=7)
    fig.legend(loc="upper right", fontsize=7, handles=[*bars.get_legend_handles_labels()[0],
                                                      *itl.get_legend_handles_labels()[0]])
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def study_rates(results: list[dict], path: Path, title: str) -> Path:
    """Goodput, p99 ITL and p99 TTFT against the request rate, one line per topology."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in dict.fromkeys(r["topology"] for r in results):
        runs = sorted((r for r in results if r["topology"] == name), key=lambda r: float(r["request_rate"]))
        rates = [float(r["request_rate"]) for r in runs]
        for ax, key in zip(axes, ("request_goodput", "p99_itl_ms", "p99_ttft_ms")):
            ax.plot(rates, [r[key] for r in runs], marker="o", label=name)
    for ax, label in zip(axes, ("goodput (req/s)", "p99 ITL (ms)", "p99 TTFT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    fig.clear()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
