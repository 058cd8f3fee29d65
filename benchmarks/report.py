"""Result rows -> stdout table, markdown summary, JSON and a PNG plot."""

from __future__ import annotations

import json
import math
import shlex
import sys
from pathlib import Path
from typing import Any

PASS_ORDER = {"fwd": 0, "bwd": 1, "bwd_data": 2}

LEGEND = (
    "Times are medians in ms; `(k x)` after a peer's time = jaxcsr is k times faster "
    "than that peer (below 1: the peer is faster); `floor ms` = the cell's floor bytes "
    "(read the inputs once, write the output once) / measured copy bandwidth; `GB/s` = "
    "floor bytes / jaxcsr's time; `x floor` = jaxcsr's time / floor; `!` = the peer's "
    "output differs from jaxcsr's beyond the tolerance (after jaxcsr's time: jaxcsr's "
    "differs from the float64 numpy/scipy reference); `error` = the peer cannot run "
    "the cell, `timed out` = its first call ran past the per-cell budget (`--budget`; "
    "reasons below the table); `-` = not applicable."
)

# One colour and marker per system, the same in every panel.
STYLE = {
    "segment_sum": ("tab:blue", "o"),
    "segment_sum_sorted": ("tab:orange", "s"),
    "bcsr": ("tab:green", "^"),
    "bcoo": ("tab:red", "v"),
    "scipy": ("tab:purple", "D"),
    "torch_index_add": ("tab:brown", "P"),
    "torch_scatter_reduce": ("tab:pink", "X"),
    "torch_sparse_csr": ("tab:gray", "*"),
}


def _fmt_ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.2f}" if ms < 10 else f"{ms:.1f}" if ms < 100 else f"{ms:.0f}"


def _cell(row: dict[str, Any], system: str) -> str:
    r = row["systems"].get(system)
    if r is None:
        return "-"
    if r.get("error"):
        return "timed out" if r["error"].startswith("timed out") else "error"
    text = _fmt_ms(r["median_s"])
    if system == "jaxcsr" and r.get("mismatch"):
        return text + " !"  # differs from the float64 reference
    if system != "jaxcsr":
        text += f" ({r['median_s'] / row['systems']['jaxcsr']['median_s']:.2f}x)"
    if r.get("mismatch"):
        text += " !"
    return text


def table(rows: list[dict[str, Any]], systems: list[str], markdown: bool) -> str:
    """One line per cell: jaxcsr's time, each peer's time and jaxcsr's speed-up over it.

    ``(1.90x)`` after a peer's time means jaxcsr is 1.90x faster than that peer;
    ``!`` marks a peer whose output differs from jaxcsr's beyond the tolerance.
    """
    head = ["graph", "workload", "pass", "N", "dtype", "floor ms", "GB/s", "x floor", *systems]
    lines = []
    for row in rows:
        j = row["systems"]["jaxcsr"]
        lines.append(
            [
                row["graph"],
                row["workload"],
                row["pass"],
                str(row["n_features"]),
                row["dtype"],
                _fmt_ms(row["floor_s"]),
                f"{row['floor_bytes'] / j['median_s'] / 1e9:.1f}",
                f"{j['median_s'] / row['floor_s']:.1f}",
                *(_cell(row, s) for s in systems),
            ]
        )
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines)])


def errors(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (peer, error message): why a peer could not run, and where."""
    seen: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        for name, r in row["systems"].items():
            if r.get("error"):
                where = f"{row['workload']} {row['pass']} N={row['n_features']} {row['dtype']}"
                seen.setdefault((name, r["error"]), []).append(where)
    return [
        f"- `{name}` ({len(cells)} cells, e.g. {cells[0]}): {message}"
        for (name, message), cells in seen.items()
    ]


def ratio_summary(ratios: list[float]) -> dict[str, Any]:
    """Speed-up ratios (> 1: jaxcsr faster) in four numbers: the cell count, their
    geometric mean, and how many are below 1.0x and at or above 1.3x (the targets'
    thresholds). No ratios: ``{"cells": 0}``."""
    if not ratios:
        return {"cells": 0}
    logs = [math.log(r) for r in ratios]
    return {
        "cells": len(ratios),
        "geomean": math.exp(sum(logs) / len(logs)),
        "below_1": sum(r < 1.0 for r in ratios),
        "at_least_1_3": sum(r >= 1.3 for r in ratios),
    }


def versus_best_peer(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """jaxcsr against the fastest peer of each cell (peers that ran and agree with
    jaxcsr; cells without one are left out): :func:`ratio_summary` of the ratios
    ``best peer's median / jaxcsr's``."""
    ratios = []
    for row in rows:
        systems = row["systems"]
        peers = [
            res["median_s"]
            for name, res in systems.items()
            if name != "jaxcsr" and "error" not in res and not res.get("mismatch")
        ]
        if peers and "error" not in systems["jaxcsr"]:
            ratios.append(min(peers) / systems["jaxcsr"]["median_s"])
    return ratio_summary(ratios)


def summary_line(rows: list[dict[str, Any]]) -> str:
    """One sentence of :func:`versus_best_peer`."""
    v = versus_best_peer(rows)
    if not v["cells"]:
        return "No cell had a peer to compare with."
    return (
        f"Against the best peer of each cell: geometric mean {v['geomean']:.2f}x over "
        f"{v['cells']} cells; {v['below_1']} below 1.0x, {v['at_least_1_3']} at or above 1.3x."
    )


def command_line(module: str, argv: list[str] | None) -> str:
    """The command a study ran as: ``python -m module`` and its arguments (``argv``, or
    the process's own when the study was run from the shell), quoted for a shell."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def provenance(module: str, argv: list[str] | None) -> dict[str, Any]:
    """What a results file needs to be rerun: the command, the date, jax's version and
    the commit of the checkout (with ``+dirty`` for uncommitted changes; ``None``
    outside a git checkout)."""
    import datetime
    import subprocess

    import jax

    root = Path(__file__).resolve().parent.parent
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or None
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        if commit and dirty:
            commit += "+dirty"
    except OSError:
        commit = None
    return {
        "command": command_line(module, argv),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "commit": commit,
    }


def write_study(out_dir: Path, stem: str, result: dict[str, Any], text: str) -> Path:
    """A study's ``<stem>.json`` (the result) and ``<stem>.md`` (``text``) in
    ``out_dir``; returns the markdown's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2))
    path = out_dir / f"{stem}.md"
    path.write_text(text)
    return path


def runs_line(result: dict[str, Any]) -> str:
    """How many timed runs each median is of: the configured rule and the range run."""
    config = result.get("config", {})
    runs = [
        r["runs"]
        for row in result["rows"]
        for r in row["systems"].values()
        if isinstance(r, dict) and "runs" in r
    ]
    rule = f"at least {config.get('repeats', '?')}"
    if config.get("min_time"):
        rule += (
            f", more until a cell's timed rounds took {config['min_time']:g} s "
            f"(at most {config.get('max_repeats', '?')})"
        )
    ran = f"; {min(runs)}-{max(runs)} here" if runs else ""
    return f"Timed runs per system and cell: {rule}{ran} (a peer past the budget: fewer)."


def write_outputs(result: dict[str, Any], out_dir: Path, systems: list[str]) -> list[Path]:
    """Writes ``results.json``, ``results.md`` and (with matplotlib) ``speedup.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps(result, indent=1))
    env = result["environment"]
    bw = result["bandwidth"]
    md = [
        f"# jaxcsr CPU benchmark ({result['date']})",
        "",
        f"Machine: {env['cpu']} ({env['cpu_count']} cores), jax {env['jax']}, "
        f"numpy {env['numpy']}, scipy {env['scipy']}, torch {env['torch']}.",
        f"Measured bandwidth: read {bw['read_gbps']:.1f} GB/s, copy {bw['copy_gbps']:.1f} GB/s, "
        f"copy into fresh memory {bw['fresh_copy_gbps']:.1f} GB/s (read + write bytes).",
        f"Command: `{result['command']}` (GLIBC_TUNABLES=`{env.get('glibc_tunables', '')}`)",
        runs_line(result),
        "",
        LEGEND,
        "",
        table(result["rows"], systems, markdown=True),
        "",
        summary_line(result["rows"]),
        "",
        *models_section(result.get("models", [])),
    ]
    failed = errors(result["rows"])
    if failed:
        md += ["Peers that could not run a cell:", "", *failed, ""]
    paths[1].write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    paths.append(out_dir / "speedup.png")
    _plot(result["rows"], systems, paths[-1], plt)
    return paths


def _speedup(row: dict[str, Any], system: str) -> float:
    return row["systems"][system]["median_s"] / row["systems"]["jaxcsr"]["median_s"]


RATIO_TICKS = (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
"""Labelled ratios on the plots' log axis (a plain log axis labels only powers of 10)."""


def _label_ratio_ticks(ax, plt) -> None:
    """Ticks at 0.5x, 1x, 2x, 5x, ... labelled as ratios, no unlabelled minor ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax.yaxis.set_major_locator(FixedLocator(RATIO_TICKS))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.yaxis.set_minor_locator(plt.NullLocator())


def _plot(rows, systems, path: Path, plt) -> None:
    """Speed-up of jaxcsr over each peer vs N, one panel per (workload, pass), on a grid.

    Each system keeps one colour and marker in every panel; float32 is solid, bfloat16
    dashed; above the line at 1 jaxcsr is faster.
    """
    panels = sorted(
        {(r["workload"], r["pass"]) for r in rows}, key=lambda k: (k[0], PASS_ORDER[k[1]])
    )
    graphs = sorted({r["graph"] for r in rows})
    dtypes = [d for d in ("float32", "bfloat16") if any(r["dtype"] == d for r in rows)]
    ncols = min(4, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False, sharey=True
    )
    handles: dict[str, Any] = {}
    for ax, (workload, pass_) in zip(axes.flat, panels, strict=False):
        for system in systems[1:]:
            color, marker = STYLE.get(system, ("black", "."))
            for graph in graphs:
                for dtype in dtypes:
                    pts = [
                        (r["n_features"], _speedup(r, system))
                        for r in rows
                        if (r["workload"], r["pass"], r["graph"], r["dtype"])
                        == (workload, pass_, graph, dtype)
                        and system in r["systems"]
                        and not r["systems"][system].get("error")
                    ]
                    if not pts:
                        continue
                    xs, ys = zip(*sorted(pts), strict=True)
                    (line,) = ax.plot(
                        xs,
                        ys,
                        color=color,
                        marker=marker,
                        linestyle="-" if dtype == "float32" else "--",
                        label=system,
                    )
                    handles.setdefault(system, line)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        widths = sorted({r["n_features"] for r in rows})
        ax.set_xticks(widths, [str(n) for n in widths])  # 16, 64, 256 -- not 2^4 ...
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.set_yscale("log")
        _label_ratio_ticks(ax, plt)
        ax.set_title(f"{workload} {pass_}", fontsize=10)
        ax.set_xlabel("N (features)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax in axes[:, 0]:
        ax.set_ylabel("peer time / jaxcsr time")
    fig.suptitle(
        f"jaxcsr speed-up over each peer on {', '.join(graphs)} "
        "(> 1: jaxcsr faster; solid float32, dashed bfloat16)",
        fontsize=11,
    )
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=4, fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def models_section(rows: list[dict[str, Any]]) -> list[str]:
    """The main job's models section (:func:`benchmarks.models.run`'s rows): one line
    per step, jaxcsr's time and each peer's with jaxcsr's speedup over it, and the
    step without aggregation (its floor, and the speedup over jax.ops it bounds)."""
    if not rows:
        return []
    lines = [
        "## Whole training steps (value and gradient, SGD update; ms, median)",
        "",
        "| graph | model | jaxcsr ms | peers: ms (jaxcsr speedup) | no aggregation: ms "
        "(largest possible speedup) | loss difference |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peers = ", ".join(f"{k} {r['ms'][k]:.2f} ({r['speedup'][k]:.2f}x)" for k in r["speedup"])
        floor = f"{r['floor_ms']:.2f} ({r['ceiling']:.2f}x)" if "floor_ms" in r else "-"
        lines.append(
            f"| {r['graph']} | {r['model']} | {r['ms']['jaxcsr']:.2f} | {peers} | {floor} "
            f"| {r['loss_difference']:.1e} |"
        )
    versus_ops = [r["speedup"]["jax.ops"] for r in rows if "jax.ops" in r["speedup"]]
    if versus_ops:
        mean = ratio_summary(versus_ops)["geomean"]
        lines += ["", f"jaxcsr against the jax.ops model: geometric mean {mean:.2f}x, "
                      f"min {min(versus_ops):.2f}x over {len(versus_ops)} steps. "
                      "No aggregation: the step with every jaxcsr call replaced by a "
                      "stand-in of the same shapes that reduces nothing; jax.ops ms over "
                      "it is the most any aggregation could gain."]  # fmt: skip
    return [*lines, ""]
