"""The benchmark runs end to end in a tiny configuration, so it cannot rot."""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import measure, report
from benchmarks.__main__ import main
from benchmarks.datasets import EMBEDDED, load_graph
from jaxcsr.kernels import cpu


@pytest.mark.parametrize("name", EMBEDDED)
def test_embedded_graphs_load(name):
    g = load_graph(name)
    assert g.num_edges > 0 and g.src.shape == g.dst.shape
    assert g.dst.min() >= 0 and max(g.src.max(), g.dst.max()) < g.num_nodes
    adj = g.normalized_adjacency()
    assert adj.shape == (g.num_nodes, g.num_nodes) and adj.nnz == g.num_edges + g.num_nodes


def test_quick_benchmark_writes_checked_results(tmp_path, capsys):
    result = main(["--quick", "--out", str(tmp_path), "--repeats", "2"])
    rows = result["rows"]
    assert {(r["workload"], r["pass"]) for r in rows} == {
        ("segment", "fwd"),
        ("segment", "bwd"),
        ("last_axis", "fwd"),
        ("last_axis", "bwd"),
        ("spmm", "fwd"),
        ("spmm", "bwd"),
        ("spmm", "bwd_data"),
        ("segment_mean", "fwd"),
        ("segment_mean", "bwd"),
        ("segment_max", "fwd"),
        ("segment_max", "bwd"),
        ("segment_softmax", "fwd"),
        ("segment_softmax", "bwd"),
    }
    for row in rows:
        ours = row["systems"]["jaxcsr"]
        assert ours["median_s"] > 0
        # jaxcsr's own output against the cell's float64 numpy/scipy reference
        assert ours["rel_error_float64"] <= measure.TOLERANCE["float32"], (row, ours)
        for name, res in row["systems"].items():
            if name != "jaxcsr" and "error" not in res:
                assert not res["mismatch"], (row["workload"], row["pass"], name, res)
    # at least the always-installed JAX peers ran in every segment-form cell
    seg = [r for r in rows if r["workload"] == "segment"]
    assert all(
        {"segment_sum", "segment_sum_sorted", "bcsr", "bcoo"} <= set(r["systems"]) for r in seg
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["bandwidth"]["copy_gbps"] > 0 and len(saved["rows"]) == len(rows)
    assert "| graph |" in (tmp_path / "results.md").read_text()
    assert report.summary_line(rows) in (tmp_path / "results.md").read_text()
    assert "jaxcsr" in capsys.readouterr().out
    # the models section: cora's GCN and GAT steps and the molecule batch, each system
    # stepping to the same loss as jaxcsr
    models = saved["models"]
    assert [m["model"].split(" ")[:2] for m in models] == [
        ["gcn", "step"], ["gat", "step"], ["molecule", "step"]
    ]  # fmt: skip
    assert all(m["loss_difference"] < 1e-5 and set(m["speedup"]) >= {"jax.ops"} for m in models)
    assert "## Whole training steps" in (tmp_path / "results.md").read_text()
    # each step's floor is timed beside it, not reported as a peer
    assert all("no aggregation" not in m["ms"] and m["floor_ms"] > 0 for m in models)
    assert all(m["ceiling"] == pytest.approx(m["ms"]["jax.ops"] / m["floor_ms"]) for m in models)


def test_floor_stand_in_keeps_the_sum_s_shape():
    from benchmarks.models import _no_reduction

    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(0, 5, 7))
    for rows, segments in ((7, 5), (3, 5)):  # more values than segments, and fewer
        values = jnp.asarray(rng.uniform(-1, 1, (rows, 4)), jnp.float32)
        want = jax.ops.segment_sum(values, ids[:rows], segments)
        got = _no_reduction(values, ids[:rows], segments)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got[: min(rows, segments)], values[:segments])


def _row(ours, **peers):
    """A result row with jaxcsr's and the peers' medians (a peer given None errored)."""
    systems = {"jaxcsr": {"median_s": ours}}
    for name, t in peers.items():
        systems[name] = {"error": "x"} if t is None else {"median_s": t, "mismatch": False}
    return {"systems": systems}


def test_versus_best_peer_takes_the_fastest_agreeing_peer():
    rows = [
        _row(1.0, a=2.0, b=4.0),  # 2.0x
        _row(2.0, a=1.0, b=None),  # 0.5x (the errored peer is skipped)
        _row(1.0, a=None),  # no peer: left out
        _row(1.0, a=1.3),  # 1.3x
    ]
    rows.append(_row(1.0, a=0.1))
    rows[-1]["systems"]["a"]["mismatch"] = True  # a wrong answer is not a peer: left out
    v = report.versus_best_peer(rows)
    assert v["cells"] == 3 and (v["below_1"], v["at_least_1_3"]) == (1, 2)
    np.testing.assert_allclose(v["geomean"], (2.0 * 0.5 * 1.3) ** (1 / 3))


def test_timed_rounds_run_until_the_minimum_time_within_the_cap():
    """``repeats`` rounds at least; more while the timed rounds took under
    ``min_time_s``; never past ``max_repeats``; a peer past its budget stops early."""
    import time

    def sleeper(seconds):
        return lambda: time.sleep(seconds) or np.ones(2, np.float32)

    thunks = {"a": sleeper(0.002), "b": sleeper(0.001)}
    exact, _ = measure.time_in_turns(thunks, repeats=2)
    assert [t.runs for t in exact.values()] == [2, 2]
    longer, _ = measure.time_in_turns(thunks, repeats=2, min_time_s=0.04, max_repeats=200)
    runs = longer["a"].runs
    assert longer["b"].runs == runs and 2 < runs < 200
    # on until the time was spent (each round sleeps at least 3 ms), and no further
    assert runs * (longer["a"].median_s + longer["b"].median_s) >= 0.8 * 0.04
    assert (runs - 1) * 0.003 < 0.04
    capped, _ = measure.time_in_turns(thunks, repeats=2, min_time_s=10.0, max_repeats=5)
    assert [t.runs for t in capped.values()] == [5, 5]
    slow = {"jaxcsr": sleeper(0.001), "peer": sleeper(0.02)}
    timings, _ = measure.time_rounds(
        slow,
        {"jaxcsr": 0.001, "peer": 0.02},
        repeats=1,
        budget_s=0.05,
        unbounded=("jaxcsr",),
        min_time_s=0.1,
        max_repeats=500,
    )
    assert timings["peer"].runs < timings["jaxcsr"].runs
    with pytest.raises(ValueError, match="max_repeats"):
        measure.time_in_turns(thunks, repeats=3, max_repeats=2)


def test_relative_error_detects_mismatch():
    rng = np.random.default_rng(1)
    a = rng.uniform(-1, 1, (5, 3)).astype(np.float32)
    assert measure.relative_error(a, a) == 0.0
    assert measure.relative_error(a + 0.1, a) > measure.TOLERANCE["float32"]
    assert measure.relative_error(a[:4], a) == float("inf")


def test_attention_benchmark_checks_and_writes(tmp_path):
    from benchmarks.studies import attention

    argv = ["--graphs", "cora", "--softmax-widths", "1,3", "--sddmm-widths", "4"]
    rows = attention.main([*argv, "--repeats", "1", "--out", str(tmp_path)])
    cells = {(r["workload"], r["pass"], r["N"]) for r in rows}
    assert cells == {
        ("edge_softmax", "fwd", 1),
        ("edge_softmax", "fwd+bwd", 1),
        ("edge_softmax", "fwd", 3),
        ("edge_softmax", "fwd+bwd", 3),
        ("sddmm", "fwd", 4),
    }
    assert all(r["ratio_vs_best_jax"] and min(r["median_s"].values()) > 0 for r in rows)
    assert "### edge_softmax" in (tmp_path / "attention.md").read_text()
    assert len(json.loads((tmp_path / "attention.json").read_text())["rows"]) == 5
    # --shuffle: the edges in random order (unsorted segment ids), still checked
    argv = ["--graphs", "cora", "--softmax-widths", "2", "--sddmm-widths", "", "--shuffle"]
    rows = attention.main([*argv, "--repeats", "1"])
    assert {(r["graph"], r["pass"]) for r in rows} == {
        ("cora shuffled", "fwd"),
        ("cora shuffled", "fwd+bwd"),
    }


def test_strategy_crossover_table(tmp_path):
    from benchmarks.studies import strategies

    rows = strategies.main(
        ["--graphs", "cora", "--widths", "1,8", "--repeats", "1", "--out", str(tmp_path)]
    )
    structures = {r["structure"] for r in rows}
    assert structures == {"segment ids, sorted", "segment ids, unsorted", "general (adjacency)"}
    for r in rows:  # what jaxcsr picks is one of the strategies timed for the structure
        assert r["chosen"] in r["median_s"]
    assert "| chosen |" in (tmp_path / "strategies.md").read_text()


def test_last_axis_study(tmp_path):
    """Every form of ``values @ A.T`` agrees with jax.ops; the table has both passes."""
    from benchmarks.studies import last_axis

    result = last_axis.main(
        ["--graph", "cora", "--features", "3", "--dtypes", "float32", "--repeats", "1",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert {r["pass"] for r in result["rows"]} == {"fwd", "bwd"}
    for r in result["rows"]:
        assert max(r["rel_error_vs_jax_ops"].values()) <= 1e-5
    assert "| fwd | 3 | float32 |" in (tmp_path / "last_axis.md").read_text()


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_pull_or_push_study(tmp_path):
    """Cora's shuffled ids reduce in one piece at N = 8 (pull, push and XLA's scatter:
    the same bits), uniform ids with 20 a row in 4 pieces at N = 3 (errors near
    float64)."""
    from benchmarks.studies import pull_or_push

    result = pull_or_push.main(
        ["--graphs", "cora", "--synthetic", "40000/2000", "--features", "3,8",
         "--dtypes", "float32", "--repeats", "1", "--pieces", "1,4", "--out", str(tmp_path)]
    )  # fmt: skip
    rows = {(r["structure"], r["n"]): r for r in result["rows"]}
    one_piece = rows[("cora shuffled", 8)]
    assert one_piece["pieces"] == 1 and one_piece["same_bits"] == {"pull": True, "xla": True}
    assert rows[("uniform 40000 ids", 3)]["pieces"] == 4
    for r in rows.values():
        assert 0 < max(r["max_abs_error"].values()) < 1e-4, r
    text = (tmp_path / "pull_or_push.md").read_text()
    assert "| cora shuffled | 2708 | 10556 | 8 | float32 | 1 |" in text


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")
def test_timed_choice_study(tmp_path, monkeypatch):
    """Uniform ids in one piece at N = 2 and 8: each cell traced by the rule and with
    timed choices (timed into a scratch directory, not the machine's own file), the
    same bits both ways, the errors near float64; the user's cache is left as it was."""
    from benchmarks.studies import timed_choice
    from jaxcsr import timed_choices

    monkeypatch.setenv("JAXCSR_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["--graphs", "", "--synthetic", "40000/25000", "--features", "2,8"]
    result = timed_choice.main([*argv, "--repeats", "1", "--out", str(tmp_path)])
    assert [r["n"] for r in result["rows"]] == [2, 8]
    for r in result["rows"]:
        assert r["same_bits"] and 0 < r["max_abs_error"] < 1e-5, r
        assert r["rule"] == "pull" and r["timed"] in timed_choices.candidates(r["n"], 4)
        assert "timed on this machine" in r["timed_reason"] and r["timing_s"] > 0
    assert not timed_choices.choices_file().exists()  # timed in the study's scratch directory
    text = (tmp_path / "timed_choice.md").read_text()
    assert "| uniform 40000 ids | 25000 | 40000 | 8 | pull |" in text
    assert "same bits in 2 of 2 cells" in text


def test_random_graphs_study(tmp_path):
    """Two small uniform graphs at N = 1 and 4: static and traced, forward and forward
    + backward, every jaxcsr output within float32 rounding of jax.ops'."""
    from benchmarks.studies import random_graphs

    argv = ["--rows", "300,5000", "--ids", "20000", "--features", "1,4", "--repeats", "1"]
    result = random_graphs.main([*argv, "--out", str(tmp_path)])
    assert len(result["rows"]) == 16  # 2 graphs x 2 widths x static/traced x fwd/fwd+bwd
    assert all(0 <= r["max_relative_difference"] < 1e-5 for r in result["rows"])
    text = (tmp_path / "random_graphs.md").read_text()
    assert "| 20000 | 5000 | 4 | traced | fwd+bwd |" in text
    assert "- static ids, fwd: geometric mean" in text


def test_busy_core_study(tmp_path):
    """Cora at N = 4, quiet and with core 0 spinning: every system's output agrees."""
    from benchmarks.studies import busy_core

    argv = ["--graphs", "cora", "--synthetic", "", "--features", "4", "--repeats", "1"]
    result = busy_core.main([*argv, "--out", str(tmp_path)])
    assert {r["busy"] for r in result["rows"]} == {False, True}
    assert len(result["rows"]) == 8  # static and traced, fwd and fwd+bwd, quiet and busy
    assert all(r["max_relative_difference"] < 1e-5 for r in result["rows"])
    assert "| cora shuffled | 4 | traced | fwd+bwd |" in (tmp_path / "busy_core.md").read_text()


def test_studies_backward_is_computed_at_run_time():
    """Static ids, fwd+bwd: jax.ops' gradient (a gather of the cotangent by the ids)
    must stay in the compiled program; a closed-over cotangent let XLA fold it into a
    constant, and the study timed nothing."""
    from benchmarks.studies import busy_core, random_graphs

    rng = np.random.default_rng(5)
    ids = rng.integers(0, 50, 300).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((300, 4)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((50, 4)), jnp.float32)
    for fn in (
        busy_core._functions(ids, 50, False, True)["jax.ops"],
        random_graphs._function("jax.ops", ids, 50, False, True),
    ):
        hlo = fn.lower(x, ct).compile().as_text()
        assert re.search(r"= \S+ gather\(", hlo), hlo  # an instruction, not metadata
        out, grad = fn(x, ct)
        want = np.zeros((50, 4))
        np.add.at(want, ids, np.asarray(x, np.float64))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(grad, np.asarray(ct)[ids], rtol=1e-6)


def test_jax_systems_take_their_index_arrays_as_arguments():
    """No JAX system of the main benchmark holds an index array as an XLA constant
    (which XLA constant-folds at compile time: ~150 s of "Constant folding" alarms
    for BCSR's backward on tolokers). jaxcsr's segment_softmax takes host ids by its
    signature and is the one exception."""
    import re

    from benchmarks import systems

    graph = load_graph("cora")
    cases = systems.build_cases(
        graph,
        4,
        "float32",
        peers=("segment_sum", "segment_sum_sorted", "bcsr", "bcoo"),
        workloads=(
            "segment",
            "spmm",
            "last_axis",
            "segment_mean",
            "segment_max",
            "segment_softmax",
        ),
        rng=np.random.default_rng(0),
    )
    checked = 0
    for case in cases:
        for name, thunk in case.systems.items():
            if name == "jaxcsr" and case.workload == "segment_softmax":
                continue
            if not hasattr(getattr(thunk, "func", None), "lower"):
                continue  # scipy / torch
            text = thunk.func.lower(*thunk.args).as_text()
            sizes = [
                int(np.prod([int(d) for d in shape.split("x")[:-1]] or [1]))
                for shape in re.findall(
                    r"stablehlo\.constant dense<\"0x[0-9A-F]+\"> : tensor<([^>]+)>", text
                )
            ]
            assert max(sizes, default=0) < graph.num_edges, (case.workload, case.pass_, name)
            checked += 1
    assert checked >= 40


def test_progress_eta_budget_and_smoke_label(tmp_path, capsys):
    """Per-cell elapsed/ETA and per-system lines; a system past the budget is reported
    as timed out (and listed under the table); --quick says it is a smoke run."""
    import time

    from benchmarks import report, systems
    from benchmarks.__main__ import run_case

    case = systems.Case(
        "g",
        "segment",
        "fwd",
        1,
        "float32",
        8,
        {
            "jaxcsr": lambda: np.ones(3, np.float32),
            "slow_peer": lambda: time.sleep(0.3) or np.ones(3, np.float32),
        },
    )
    res = run_case(case, repeats=3, budget_s=0.1)
    assert res["slow_peer"]["error"].startswith("timed out")
    row = {
        "graph": "g",
        "workload": "segment",
        "pass": "fwd",
        "n_features": 1,
        "dtype": "float32",
        "systems": res,
    }
    assert report._cell(row, "slow_peer") == "timed out"
    assert any("timed out" in line for line in report.errors([row]))
    main(
        [
            "--quick",
            "--out",
            str(tmp_path),
            "--workloads",
            "segment",
            "--peers",
            "bcoo",
            "--repeats",
            "1",
        ]
    )
    out = capsys.readouterr()
    assert "ETA" in out.err and "elapsed" in out.err and "bcoo" in out.err
    assert "SMOKE RUN" in out.out


def test_help_is_instant_and_shows_plain_defaults():
    """--help parses arguments without importing jax; defaults print as text."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from benchmarks.__main__ import parse_args\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):\n"
        "    parse_args(['--help'])\n"
        "assert 'jax' not in sys.modules, 'jax imported by --help'\n"
        "print(buf.getvalue())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "(default: 16,64,256)" in result.stdout and "(default: tolokers)" in result.stdout


def test_per_batch_benchmark_checks_and_writes(tmp_path):
    from benchmarks.studies import per_batch

    argv = ["--graphs", "cora", "--widths", "4", "--dtypes", "float32", "--repeats", "1"]
    argv += ["--cell-budget", "0", "--steps", "2", "--out", str(tmp_path)]
    result = per_batch.main(argv)
    cells = {(r["op"], r["mode"]) for r in result["segments"]}
    assert cells == {(op, mode) for op in per_batch.OPS for mode in ("fwd", "fwd+bwd")}
    # both systems computed the same function on the same traced ids
    assert all(r["max_relative_difference"] < 1e-4 for r in result["segments"])
    assert result["training"][0]["loss_difference"] < 1e-4
    assert result["planning"][0]["structure"] > 0
    assert "jraph-style training step" in (tmp_path / "per_batch.md").read_text()
    result = per_batch.main([*argv, "--ops", "softmax"])
    assert {r["op"] for r in result["segments"]} == {"softmax"}
    with pytest.raises(SystemExit):
        per_batch.main([*argv, "--ops", "softmax,mean"])


def test_sharded_scale_table(tmp_path):
    from benchmarks.studies import sharded_scale

    argv = ["--edges", "2e5", "--nodes", "1e4", "--devices", "4,64", "--out", str(tmp_path)]
    result = sharded_scale.main(argv)
    four, many = result["rows"]
    # more devices: smaller blocks and outputs, never below the largest row
    assert many["block_entries"] <= four["block_entries"]
    assert many["block_entries"] >= many["largest_row"]
    assert many["output_bytes"] < four["output_bytes"]
    assert "entry slots per block" in (tmp_path / "sharded_scale.md").read_text()


def test_cpu_native_study(tmp_path):
    from benchmarks.studies import cpu_native
    from jaxcsr.kernels import cpu

    if not cpu.available():
        pytest.skip("the CPU library is not built")
    kinds = "segment,segment_sorted,segment_shuffled,spmm_T"
    argv = ["--graphs", "cora", "--kinds", kinds, "--features", "8"]
    argv += ["--dtypes", "float32,bfloat16", "--repeats", "1", "--out", str(tmp_path)]
    result = cpu_native.main([*argv, "--min-time", "0"])
    assert len(result["rows"]) == 8
    for row in result["rows"]:  # every system agrees with the XLA path
        for system, diff in row["max_abs_diff_vs_xla_path"].items():
            assert diff <= (2e-2 if row["dtype"] == "bfloat16" else 1e-5), (row, system)
        assert row["gbps"] > 0 and row["best_peer"] not in cpu_native.OURS
        assert row["threads_speedup_alone"] > 0
    text = (tmp_path / "cpu_native.md").read_text()
    assert "% of copy" in text and "A copy split over threads" in text
    assert set(result["copy_by_threads"]) == {1, os.cpu_count()}
    assert 0 < result["dispatch_ms"] < 50  # ms
    assert "A jitted `x + 1`" in text


def test_allocator_study(tmp_path):
    """Every setting (glibc's, the huge-page advice off, glibc's huge pages, heap reuse)
    runs in its own process; every system times, the gathers agree (checked in the
    child)."""
    from benchmarks.studies import allocator

    argv = ["--graph", "cora", "--features", "4", "--repeats", "1", "--out", str(tmp_path)]
    result = allocator.main(argv)
    assert set(result["settings"]) == set(allocator.SETTINGS)
    for rows in result["settings"].values():
        assert [row["features"] for row in rows] == [4]
        assert all(ms > 0 for ms in rows[0]["ms"].values())
        assert set(allocator.SYSTEMS) - {"torch"} <= set(rows[0]["ms"])
    assert "heap reuse" in (tmp_path / "allocator.md").read_text()


def test_mean_in_kernel_study(tmp_path):
    """The mean divided in the kernel equals the sum divided after it bit for bit (the
    study asserts it) and jax.ops within rounding, float32 and bfloat16."""
    from benchmarks.studies import mean_in_kernel

    result = mean_in_kernel.main([
        "--graphs", "cora", "--features", "3,16", "--dtypes", "float32,bfloat16",
        "--repeats", "1", "--out", str(tmp_path),
    ])  # fmt: skip
    assert len(result["rows"]) == 8  # sorted and shuffled ids
    for row in result["rows"]:
        assert set(row["ms"]) == set(mean_in_kernel.SYSTEMS) and min(row["ms"].values()) > 0
        assert row["difference_vs_jax_ops"] < (1e-6 if row["dtype"] == "float32" else 1e-2)
        if row["order"] == "sorted":
            assert "native pull" in row["plan"], row["plan"]
    assert "after / in" in (tmp_path / "mean_in_kernel.md").read_text()


def test_gat_parts_study(tmp_path):
    """Every part of a GAT layer runs in both systems and agrees with jax.ops (3 heads of
    8 features: the SDDMM's partial group of heads)."""
    from benchmarks.studies import gat_parts

    result = gat_parts.main(
        ["--graphs", "cora", "--layers", "3x8", "--repeats", "1", "--out", str(tmp_path)]
    )
    assert [row["part"] for row in result["rows"]] == list(gat_parts.PARTS)
    for row in result["rows"]:
        assert set(row["ms"]) == set(gat_parts.SYSTEMS) and min(row["ms"].values()) > 0
        assert row["difference"] < 1e-5, row
    assert "grad alpha" in (tmp_path / "gat_parts.md").read_text()
