"""Result rows -> stdout table, markdown summary, JSON and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PASS_ORDER = {"fwd": 0, "bwd": 1, "bwd_data": 2}


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
        return "error"
    text = _fmt_ms(r["median_s"])
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
        "",
        "Times are medians in ms; `(k x)` = jaxcsr is k times faster than that peer; "
        "`floor ms` = floor bytes / copy bandwidth; `x floor` = jaxcsr time / floor; "
        "`!` = output differs from jaxcsr beyond tolerance; `-` = not applicable.",
        "",
        table(result["rows"], systems, markdown=True),
        "",
    ]
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


def _plot(rows, systems, path: Path, plt) -> None:
    """Speed-up of jaxcsr over each peer vs N, one panel per (workload, pass), float32."""
    panels = sorted(
        {(r["workload"], r["pass"]) for r in rows}, key=lambda k: (k[0], PASS_ORDER[k[1]])
    )
    graphs = sorted({r["graph"] for r in rows})
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False, sharey=True
    )
    for ax, (workload, pass_) in zip(axes[0], panels, strict=True):
        for system in systems[1:]:
            for graph in graphs:
                pts = [
                    (r["n_features"], _speedup(r, system))
                    for r in rows
                    if (r["workload"], r["pass"], r["graph"], r["dtype"])
                    == (workload, pass_, graph, "float32")
                    and system in r["systems"]
                    and not r["systems"][system].get("error")
                ]
                if pts:
                    xs, ys = zip(*sorted(pts), strict=True)
                    label = system if len(graphs) == 1 else f"{system} ({graph})"
                    ax.plot(xs, ys, marker="o", label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{workload} {pass_}", fontsize=9)
        ax.set_xlabel("N (features)")
    axes[0][0].set_ylabel("peer time / jaxcsr time (float32)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab, strict=True):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
