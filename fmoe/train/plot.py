"""Plots of a run's metrics.jsonl: `python -m fmoe.train.plot <out_dir>`.

Writes into out_dir (needs matplotlib, the `plots` extra: pip install 'fmoe[plots]'):
    loss.png         loss with val_loss (and each data source's validation loss when the
                     run blends several), and panels for the MTP losses (each depth's
                     mtp_<d>_loss), the balancing losses (seq_aux_loss, aux_loss) and z_loss,
                     those logged and not all zero (a coefficient of 0 logs zeros)
    expert_load.png  heatmaps over steps: max/mean load per MoE layer (rows: layers) and,
                     when tokens_per_expert is logged, each expert's share of its layer's
                     slots relative to uniform (count * E / sum) per layer (the computing
                     experts' when the records name zero_experts: the zero experts' share
                     is zero_fraction); each logged step's column centred on that step of
                     the x axis
    health.png       run health, the panels that were logged: grad_norm with param_norm,
                     zero_grads (parameters whose gradient is exactly zero), energy per
                     token (joules), and, for a blend, each data source's share of the step's
                     tokens

A non-finite value (NaN or inf, logged as null) breaks its line at its step, which a dotted
vertical line marks, and each panel notes how many such steps a series has; a series with
no finite value keeps its panel, with that note.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from fmoe.ops.checks import MissingExtra
from fmoe.train.metrics import read_metrics

# keys sharing an axis; mtp_*_loss: each MTP depth's (the loop's mtp_1_loss, mtp_2_loss, ...)
LOSS_PANELS = (("loss", "val_loss"), ("mtp_*_loss", "mtp_loss"), ("seq_aux_loss", "aux_loss"), ("z_loss",), ("index_loss",))
HEALTH_PANELS = (("grad_norm", "param_norm"), ("zero_grads",), ("energy_j_per_token",))
LOAD_KEYS = ("load_max_over_mean", "tokens_per_expert")
# every key some plot draws (said when a file holds none of them)
PLOTTED_KEYS = (*(k for keys in LOSS_PANELS for k in keys), *LOAD_KEYS, *(k for keys in HEALTH_PANELS for k in keys),
                "tokens_by_source")


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise MissingExtra("fmoe.train.plot needs matplotlib: pip install 'fmoe[plots]' (or matplotlib>=3.8)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(records: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the records that log `key`: a number as itself, a null (the logger's
    NaN or inf) as NaN, so that a line breaks there (_draw_panel marks it); a record without
    the key (or with another kind of value) is left out."""
    pairs = [(r["step"], math.nan if r[key] is None else r[key]) for r in records
             if key in r and (r[key] is None or _is_number(r[key]))]
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
    return [key for key in found if any(v != 0 for v in _series(records, key)[1])]  # NaN != 0: an all-null series keeps its panel


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
    return {name: _series([{"step": r["step"], "v": r[key][name]} for r in rows if name in r[key]], "v") for name in names}


def _draw_panel(ax, series: dict[str, tuple[list, list]], ylabel: str) -> None:
    """One axis: a line per named (steps, values) series, a legend when there are several. A
    non-finite value (NaN: logged as null) breaks its line, a dotted vertical line in the
    series' colour marks its step, and a note in the panel counts such steps per series
    ("loss: 2 non-finite steps (null)"; "loss: all 5 steps non-finite (null)" for a series
    with no finite value, whose panel is otherwise empty)."""
    notes = []
    for label, (steps, values) in series.items():
        (line,) = ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=label)
        bad = [step for step, v in zip(steps, values) if not math.isfinite(v)]
        for step in bad:
            ax.axvline(step, color=line.get_color(), ls=":", lw=1, alpha=0.8)
        if bad:
            notes.append(f"{label}: all {len(bad)} steps non-finite (null)" if len(bad) == len(values) > 1 else
                         f"{label}: {len(bad)} non-finite step{'s' * (len(bad) != 1)} (null)")
    if notes:
        ax.text(0.01, 0.97, "\n".join(notes), transform=ax.transAxes, va="top", ha="left", fontsize=8, color="tab:red",
                bbox=dict(facecolor="white", alpha=0.8, lw=0))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend()


def _transpose(rows: list[list]) -> list[list]:
    return [list(col) for col in zip(*rows)]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _layers(n: int) -> str:
    return f"{n} layer" + "s" * (n != 1)


def _load_matrix(records: list[dict]):
    """(steps [S], max_over_mean [L][S], shares [L][E][S] or None) from the records that carry
    per-layer load, a column per step in step order (a step logged twice: its last record);
    shares only when every such record has tokens_per_expert; None when none carries it.
    A record's zero_experts (Z: the last Z columns count zero experts' slots) leaves those
    columns out of the shares: each computing expert's count * (E - Z) / their sum.
    ValueError naming the key and the step of a malformed record, or of one whose layer (or
    expert) count differs from the first's: its rows would not be the same layers'."""
    by_step, first, first_counts = {}, None, None
    for r in records:
        step = r["step"]
        loads, counts = (None if r.get(key) == [] else r.get(key) for key in LOAD_KEYS)  # [] (no MoE layer): not logged
        if loads is None and counts is None:
            continue
        if loads is not None and not (isinstance(loads, list) and all(v is None or _is_number(v) for v in loads)):
            raise ValueError(f"records: load_max_over_mean at step {step}: expected a list of per-layer numbers, got {loads!r}")
        if counts is not None and not (isinstance(counts, list) and all(
                isinstance(layer, list) and layer and all(_is_number(c) and c >= 0 for c in layer) for layer in counts)):
            raise ValueError(f"records: tokens_per_expert at step {step}: expected a list of per-layer lists of expert "
                             f"counts (numbers >= 0), got {counts!r}")
        if loads is not None and counts is not None and len(loads) != len(counts):
            raise ValueError(f"records: load_max_over_mean at step {step} has {_layers(len(loads))}, "
                             f"its tokens_per_expert {len(counts)}")
        key, n = ("tokens_per_expert", len(counts)) if counts is not None else ("load_max_over_mean", len(loads))
        first = first or (step, n)
        if n != first[1]:
            raise ValueError(f"records: {key} at step {step} has {_layers(n)} where step {first[0]}'s has "
                             f"{first[1]}: a changed model (two runs' records?); plot each run apart")
        zero = r.get("zero_experts", 0)
        if counts is not None:
            experts = [len(layer) for layer in counts]
            if isinstance(zero, bool) or not isinstance(zero, int) or not 0 <= zero < min(experts):
                raise ValueError(f"records: zero_experts at step {step}: expected an int from 0 to {min(experts) - 1} (fewer "
                                 f"than the {min(experts)} columns of tokens_per_expert), got {zero!r}")
            first_counts = first_counts or (step, experts, zero)
            if (experts, zero) != first_counts[1:]:
                had = f"{first_counts[1]}" + (f" ({first_counts[2]} zero experts)" if first_counts[2] else "")
                raise ValueError(f"records: tokens_per_expert at step {step} has {experts} experts per layer"
                                 f"{f' ({zero} zero experts)' if zero else ''} where step {first_counts[0]}'s has {had}: "
                                 "a changed model (two runs' records?)")
        computing = [layer[:len(layer) - zero] for layer in counts] if counts is not None else None  # the zero experts' in zero_fraction
        share = [[c * len(layer) / max(sum(layer), 1e-9) for c in layer] for layer in computing] if counts is not None else None
        loads = loads if loads is not None else [max(s) for s in share]
        by_step[step] = ([math.nan if v is None else v for v in loads], share)  # a non-finite load is logged as null
    if not by_step:
        return None
    steps = sorted(by_step)
    mom, shares = [by_step[s][0] for s in steps], [by_step[s][1] for s in steps]
    per_layer = None
    if all(s is not None for s in shares):
        per_layer = [_transpose([s[layer] for s in shares]) for layer in range(len(shares[0]))]
    return steps, _transpose(mom), per_layer


def _column_edges(steps: list[int]) -> list[float]:
    """[S+1] x edges of the heatmap's columns for sorted steps [S]: midway between logged
    steps, the outer ones as far out as the neighbouring gap's half, so that each column is
    centred on its own step (its place on the loss panel's axis)."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [2 * steps[0] - mids[0], *mids, 2 * steps[-1] - mids[-1]]


def _heatmap(ax, x_edges: list[float], rows: list[list], **kwargs):
    """rows [R][S] as a mesh of columns between x_edges [S+1], row r at y = r; NaN blank."""
    import numpy as np

    values = np.ma.masked_invalid(np.asarray(rows, dtype=float))
    return ax.pcolormesh(x_edges, np.arange(len(rows) + 1) - 0.5, values, shading="flat", **kwargs)


def plot_expert_load(records: list[dict], path: Path, plt) -> bool:
    """expert_load.png; False (nothing written) when no per-layer load was logged."""
    found = _load_matrix(records)
    if found is None:
        return False
    steps, mom, per_layer = found
    # the MoE layers' names as the loop logs them (moe_layers: "layer_1", ..., "mtp_1"), else their rows
    logged = next((r["moe_layers"] for r in reversed(records) if r.get("moe_layers")), None)
    zero = next((r["zero_experts"] for r in records if r.get("zero_experts") and r.get("tokens_per_expert")), 0)
    names = list(logged) if logged is not None and len(logged) == len(mom) else [f"layer {i}" for i in range(len(mom))]
    n = 1 + (len(per_layer) if per_layer else 0)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.2 + 1.8 * n), squeeze=False)
    edges = _column_edges(steps)  # each column at its step (not spread evenly between the first and last)
    ax = axes[0, 0]
    im = _heatmap(ax, edges, mom, cmap="magma")
    ax.set_title("expert load max/mean per MoE layer")
    ax.set_yticks(range(len(names)), names)
    ax.set_ylabel("MoE layer")
    fig.colorbar(im, ax=ax)
    for layer, share in enumerate(per_layer or []):
        ax = axes[layer + 1, 0]
        im = _heatmap(ax, edges, share, cmap="coolwarm", vmin=0.0, vmax=2.0)
        ax.set_title(f"{names[layer]}: tokens per expert / uniform"
                     + (f" (the computing experts; the {zero} zero experts' share: zero_fraction)" if zero else ""))
        ax.set_ylabel("expert")
        fig.colorbar(im, ax=ax)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _source_shares(records: list[dict]) -> dict[str, tuple[list, list]]:
    """source -> (steps, its share of the step's tokens) from tokens_by_source records;
    ValueError naming the step of one that is not a count per source."""
    for r in records:
        counts = r.get("tokens_by_source")
        if counts is not None and not (isinstance(counts, dict) and all(_is_number(c) and c >= 0 for c in counts.values())):
            raise ValueError(f"records: tokens_by_source at step {r['step']}: expected a token count (a number >= 0) "
                             f"per source, got {counts!r}")
    rows = [r for r in records if r.get("tokens_by_source") and sum(r["tokens_by_source"].values())]
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
        finite = [v for _, values in series.values() for v in values if math.isfinite(v)]
        if len(keys) > 1 and finite and all(v > 0 for v in finite):
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
    FileNotFoundError without the file; ValueError when it holds no record, a malformed one
    (before any file is written) or nothing any plot draws."""
    out_dir = Path(out_dir)
    metrics = out_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"out_dir: no metrics.jsonl in {str(out_dir)!r}")
    records = read_metrics(metrics)
    if not records:  # said, not an exit with nothing written
        raise ValueError(f"out_dir: {str(metrics)!r} holds no records (no step was logged yet)")
    _load_matrix(records), _source_shares(records)  # a malformed record: said before any file is written
    plt = _pyplot()
    written = []
    for name, fn in (("loss.png", plot_losses), ("expert_load.png", plot_expert_load), ("health.png", plot_health)):
        if fn(records, out_dir / name, plt):
            written.append(out_dir / name)
    if not written:  # said, not an exit 0 that wrote nothing
        logged = sorted({key for r in records for key in r} - {"step"})
        raise ValueError(f"out_dir: nothing to plot in {str(metrics)!r}: the plots draw {', '.join(PLOTTED_KEYS)} "
                         f"(a loss of zeros, or one source's tokens_by_source, draws nothing); its records log "
                         f"{', '.join(logged) or 'only steps'}")
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
