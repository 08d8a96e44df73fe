"""`--plot`: histograms of TTFT and ITL, one series per request group (matplotlib, optional)."""

from __future__ import annotations

from tokenserve.benchmarks.openai_client import RequestResult


def require_matplotlib() -> None:
    """Fail before the benchmark runs, not after, when the optional dependency is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ValueError(
            "--plot needs matplotlib: pip install 'tokenserve[bench]' (or matplotlib)."
        ) from error


def plot_latencies(results: list[RequestResult], path: str, title: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on a server
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    groups = sorted({r.group for r in done})
    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for group in groups:
        members = [r for r in done if r.group == group]
        label = None if groups == ["all"] else group
        ttfts = [r.ttft * 1000 for r in members if r.ttft is not None]
        itls = [gap * 1000 for r in members for gap in r.inter_token_latencies]
        if ttfts:
            ttft_axes.hist(ttfts, bins=30, alpha=0.6, label=label)
        if itls:
            itl_axes.hist(itls, bins=50, alpha=0.6, label=label)
    for axes, name in ((ttft_axes, "TTFT"), (itl_axes, "ITL")):
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("count")
        axes.set_title(name)
        if groups != ["all"]:
            axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
