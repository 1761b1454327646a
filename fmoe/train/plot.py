"""Plots of a run's metrics.jsonl: `python -m fmoe.train.plot <out_dir>`.

Writes into out_dir (needs matplotlib, the `plots` extra: pip install 'fmoe[plots]'):
    loss.png         loss with val_loss (and each data source's validation loss when the
                     run blends several), and panels for the MTP losses (each depth's
                     mtp_<d>_loss), the balancing losses (seq_aux_loss, aux_loss) and z_loss,
                     those logged and not all zero (a coefficient of 0 logs zeros)
    expert_load.png  heatmaps over steps: max/mean load per MoE layer (rows: layers) and,
                     when tokens_per_expert is logged, each expert's share of its layer's
                     slots relative to uniform (count * E / sum) per layer
    health.png       run health, the panels that were logged: grad_norm with param_norm,
                     zero_grads (parameters whose gradient is exactly zero), energy per
                     token (joules), and, for a blend, each data source's share of the step's
                     tokens
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from fmoe.train.metrics import read_metrics

# keys sharing an axis; mtp_*_loss: each MTP depth's (the loop's mtp_1_loss, mtp_2_loss, ...)
LOSS_PANELS = (("loss", "val_loss"), ("mtp_*_loss", "mtp_loss"), ("seq_aux_loss", "aux_loss"), ("z_loss",), ("index_loss",))
HEALTH_PANELS = (("grad_norm", "param_norm"), ("zero_grads",), ("energy_j_per_token",))


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("fmoe.train.plot needs matplotlib: pip install 'fmoe[plots]' (or matplotlib>=3.8)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: str) -> tuple[list, list]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _logged(records: list[dict], keys) -> list[str]:
    """A panel's keys as the records hold them: a `*` key expanded to each logged key it
    matches (by its number), and a series of zeros left out (the loop logs 0 for a balancing
    loss whose coefficient is 0: it is not computed)."""
    found = []
    for key in keys:
        if "*" in key:
            pattern = re.compile(re.escape(key).replace(r"\*", r"(\d+)"))
            matches = {k: int(m.group(1)) for r in records for k in r if (m := pattern.fullmatch(k))}
            found += sorted(matches, key=matches.get)
        else:
            found.append(key)
    return [key for key in found if any(v != 0 for v in _series(records, key)[1])]


def plot_losses(records: list[dict], path: Path, plt) -> bool:
    """loss.png; False (nothing written) when no loss was logged."""
    panels = [keys for keys in (_logged(records, keys) for keys in LOSS_PANELS) if keys]
    if not panels:
        return False
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    by_source = _per_source(records, "val_loss_by_source")
    for ax, keys in zip(axes[:, 0], panels):
        series = {key: _series(records, key) for key in keys}
        if "val_loss" in keys and len(by_source) > 1:  # a blend: each source's validation loss beside the mean
            series.update({f"val_loss {name}": values for name, values in by_source.items()})
        _draw_panel(ax, series, " / ".join(keys))
    axes[0, 0].set_title("losses")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _per_source(records: list[dict], key: str) -> dict[str, tuple[list, list]]:
    """name -> (steps, values) of the records' `key` dicts (e.g. val_loss_by_source)."""
    rows = [r for r in records if isinstance(r.get(key), dict)]
    names = sorted({name for r in rows for name in r[key]})
    return {name: _series([{"step": r["step"], "v": r[key].get(name)} for r in rows], "v") for name in names}


def _draw_panel(ax, series: dict[str, tuple[list, list]], ylabel: str) -> None:
    """One axis: a line per named (steps, values) series, a legend when there are several."""
    for label, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=label)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()


def _transpose(rows: list[list]) -> list[list]:
    return [list(col) for col in zip(*rows)]


def _load_matrix(records: list[dict]):
    """(steps, max_over_mean [L][steps], shares [L][E][steps] or None) from the records that
    carry per-layer load; shares only when every such record has tokens_per_expert."""
    rows = [r for r in records if r.get("load_max_over_mean") or r.get("tokens_per_expert")]
    if not rows:
        return None
    steps, mom, shares = [], [], []
    for r in rows:
        counts = r.get("tokens_per_expert")
        share = [[c * len(layer) / max(sum(layer), 1e-9) for c in layer] for layer in counts] if counts else None
        loads = r.get("load_max_over_mean") or [max(s) for s in share]
        mom.append([math.nan if v is None else v for v in loads])  # a non-finite load is logged as null
        shares.append(share)
        steps.append(r["step"])
    per_layer = None
    if all(s is not None for s in shares):
        per_layer = [_transpose([s[layer] for s in shares]) for layer in range(len(shares[0]))]
    return steps, _transpose(mom), per_layer


def plot_expert_load(records: list[dict], path: Path, plt) -> bool:
    """expert_load.png; False (nothing written) when no per-layer load was logged."""
    found = _load_matrix(records)
    if found is None:
        return False
    steps, mom, per_layer = found
    # the MoE layers' names as the loop logs them (moe_layers: "layer_1", ..., "mtp_1"), else their rows
    logged = next((r["moe_layers"] for r in reversed(records) if r.get("moe_layers")), None)
    names = list(logged) if logged is not None and len(logged) == len(mom) else [f"layer {i}" for i in range(len(mom))]
    n = 1 + (len(per_layer) if per_layer else 0)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 + 1.8 * n), squeeze=False)
    extent = (steps[0] - 0.5, steps[-1] + 0.5)
    ax = axes[0, 0]
    im = ax.imshow(mom, aspect="auto", origin="lower", interpolation="nearest", cmap="magma",
                   extent=(*extent, -0.5, len(mom) - 0.5))
    ax.set_title("expert load max/mean per MoE layer")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax)
    for layer, share in enumerate(per_layer or []):
        ax = axes[layer + 1, 0]
        im = ax.imshow(share, aspect="auto", origin="lower", interpolation="nearest", cmap="coolwarm",
                       vmin=0.0, vmax=2.0, extent=(*extent, -0.5, len(share) - 0.5))
        ax.set_title(f"{names[layer]}: tokens per expert / uniform")
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _source_shares(records: list[dict]) -> dict[str, tuple[list, list]]:
    """source -> (steps, its share of the step's tokens) from tokens_by_source records."""
    rows = [r for r in records if isinstance(r.get("tokens_by_source"), dict) and sum(r["tokens_by_source"].values())]
    names = sorted({name for r in rows for name in r["tokens_by_source"]})
    return {name: ([r["step"] for r in rows], [r["tokens_by_source"].get(name, 0) / sum(r["tokens_by_source"].values()) for r in rows])
            for name in names}


def plot_health(records: list[dict], path: Path, plt) -> bool:
    """health.png; False (nothing written) when none of its signals was logged."""
    panels = [[key for key in keys if _series(records, key)[0]] for keys in HEALTH_PANELS]
    panels = [keys for keys in panels if keys]
    shares = _source_shares(records)
    shares = shares if len(shares) > 1 else {}  # one source's share is 1 at every step: no panel
    n = len(panels) + bool(shares)
    if not n:
        return False
    fig, axes = plt.subplots(n, 1, figsize=(8, 2.6 * n), sharex=True, squeeze=False)
    for ax, keys in zip(axes[:, 0], panels):
        series = {key: _series(records, key) for key in keys}
        _draw_panel(ax, series, " / ".join(keys))
        if len(keys) > 1 and all(v > 0 for _, values in series.values() for v in values):
            ax.set_yscale("log")  # the gradient's norm beside the weights', tens of times larger
    if shares:
        _draw_panel(axes[-1, 0], shares, "share of tokens")
        axes[-1, 0].set_ylim(0, 1.05)  # a share of 1 above the frame, not on it
    axes[0, 0].set_title("run health")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plot_run(out_dir) -> list[Path]:
    """Write the plots of `<out_dir>/metrics.jsonl` into out_dir; returns the written paths.
    FileNotFoundError without the file, ValueError when it holds no record."""
    out_dir = Path(out_dir)
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"out_dir: no metrics.jsonl in {str(out_dir)!r}")
    records = read_metrics(metrics)
    if not records:  # said, not an exit with nothing written
        raise ValueError(f"out_dir: {str(metrics)!r} holds no records (no step was logged yet)")
    plt = _pyplot()
    written = []
    for name, fn in (("loss.png", plot_losses), ("expert_load.png", plot_expert_load), ("health.png", plot_health)):
        if fn(records, out_dir / name, plt):
            written.append(out_dir / name)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fmoe.train.plot", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="a run directory holding metrics.jsonl")
    args = parser.parse_args(argv)
    try:
        written = plot_run(args.out_dir)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
