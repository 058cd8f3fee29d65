"""The machine profile (jaxcsr.machine) and the choices that read it.

Calibration: once per machine (a temporary cache directory), under 2 s, stored and read
back; off, the defaults. Choices: two synthetic machines choose differently where the
rule says they should, and every choice gives the same bits. The GPU rule: kernel or XLA
path by dtype and reduction, as the H200 table measured.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, power_law_ids, random_values, reduce_reference

import jaxcsr
from jaxcsr import CSRMatrix, machine
from jaxcsr.kernels import cpu, gpu, tpu

MiB = 1 << 20
SMALL = machine.MachineProfile("synthetic A", cores=2, l2_bytes=1 * MiB, l3_bytes=4 * MiB)
LARGE = machine.MachineProfile("synthetic B", cores=2, l2_bytes=2 * MiB, l3_bytes=100 * MiB)

needs_native = pytest.mark.skipif(not cpu.available(), reason="native CPU kernels not built")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache directory and no profile in this process (restored after)."""
    monkeypatch.setenv("JAXCSR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("JAXCSR_CALIBRATE", raising=False)
    saved = machine._CURRENT
    machine._forget()
    yield tmp_path
    machine._CURRENT = saved


def test_first_use_calibrates_once_under_two_seconds(fresh, monkeypatch):
    jnp.zeros(1).block_until_ready()  # jax itself imported and started, as on first use
    start = time.perf_counter()
    found = machine.profile()
    spent = time.perf_counter() - start
    assert found.source == "measured" and spent < 2.0, spent
    assert found.cores >= 1 and found.l2_bytes > 0
    for name in ("read_gbs", "copy_gbs", "write_gbs", "call_floor_us"):
        assert 0 < getattr(found, name) < 1e4, name
    stored = json.loads(machine.cache_file().read_text())
    assert stored["profile"]["read_gbs"] == found.read_gbs
    assert [p.name for p in fresh.iterdir()] == [machine.cache_file().name]

    # a second process (here: this one, forgetting) reads the file and measures nothing
    def no_measurement(reported):
        raise AssertionError("measured again")

    monkeypatch.setattr(machine, "_measure", no_measurement)
    machine._forget()
    again = machine.profile()
    assert again.source == "file"
    assert again == machine.dataclasses.replace(found, source="file")


def test_first_use_inside_a_jitted_product_calibrates(tmp_path):
    """A fresh process whose first use of the profile is a product being lowered (as
    on a new machine): the measurement runs eagerly beside the trace and is stored."""
    program = (
        "import numpy as np, jax, jax.numpy as jnp, jaxcsr\n"
        "A = jaxcsr.CSRMatrix.from_indices(np.array([0, 2, 2, 1]), 3)\n"
        "y = jax.jit(lambda A, x: A.T @ x)(A, jnp.ones((3, 4)))\n"
        "assert np.asarray(y).tolist() == [[1.0] * 4] * 4\n"
        "from jaxcsr import machine\n"
        "print(machine.profile().source, machine.profile().call_floor_us)\n"
    )
    env = {**os.environ, "JAXCSR_CACHE_DIR": str(tmp_path)}
    env.pop("JAXCSR_CALIBRATE", None)
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    source, floor = run.stdout.split()
    assert source == "measured" and 0 < float(floor) < 1e4
    assert len(list(tmp_path.glob("machine-*.json"))) == 1


def test_calibration_off_gives_the_defaults_and_stores_nothing(fresh, monkeypatch):
    monkeypatch.setenv("JAXCSR_CALIBRATE", "0")
    assert machine.profile() is machine.DEFAULT
    assert list(fresh.iterdir()) == []
    assert machine.DEFAULT.stream_bytes == 24 * MiB  # the backend's original threshold


def test_a_damaged_file_is_measured_again(fresh):
    path = machine.cache_file()
    path.write_text("{not json")
    assert machine.profile().source == "measured"
    assert json.loads(path.read_text())["profile"]["cores"] >= 1


def test_calibrate_command_prints_and_stores(fresh):
    run = subprocess.run(
        [sys.executable, "-m", "jaxcsr.calibrate"], capture_output=True, text=True, check=True
    )
    assert "GB/s" in run.stdout and str(machine.cache_file()) in run.stdout
    shown = subprocess.run(
        [sys.executable, "-m", "jaxcsr.calibrate", "--show"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "(file)" in shown.stdout


def test_profiles_are_validated():
    with pytest.raises(ValueError, match="cores"):
        machine.MachineProfile("x", cores=0, l2_bytes=MiB, l3_bytes=0)
    with pytest.raises(ValueError, match="l2_bytes"):
        machine.MachineProfile("x", cores=1, l2_bytes=-1, l3_bytes=0)
    with pytest.raises(TypeError, match="MachineProfile"), machine.use("fast"):
        pass


@needs_native
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_two_machines_choose_different_stores_and_give_the_same_bits(rng, dtype):
    """A row gather (the segment sum's backward) of a 5 MiB output: streamed past the
    caches on a machine with 4 MiB of L3 (from 3 MiB on), through them with 100 MiB
    (from 75 MiB on); with values (no streaming: each row is scaled) and without."""
    m, k, f = 500, 20000, 64
    ids = power_law_ids(rng, k, m)
    ct = random_values(rng, (m, f)).astype(dtype)
    for data in (None, random_values(rng, k).astype(np.float32)):
        A = CSRMatrix.from_indices(ids, m, data=data)
        outputs, texts = [], []
        for chosen in (SMALL, LARGE):
            with machine.use(chosen):
                fn = jax.jit(lambda A, c: A.T @ c)
                texts.append(fn.lower(A, ct).as_text())
                outputs.append(np.asarray(fn(A, ct)))
                assert (
                    f"from {chosen.stream_bytes / MiB:g} MiB"
                    in A.T.plan_info(f).strategies["forward, cpu"]
                )
        assert f"stream_bytes = {3 * MiB}" in texts[0]
        assert f"stream_bytes = {75 * MiB}" in texts[1]
        np.testing.assert_array_equal(outputs[0], outputs[1])
        want = reduce_reference(A.T, np.asarray(ct, np.float64), "sum")[0]
        assert_close(outputs[0], want, dtype)


@needs_native
def test_strategy_says_what_runs_and_why(rng):
    few = CSRMatrix.from_indices(rng.integers(0, 3000, 5000), 3000)  # 1.7 ids per row
    many = CSRMatrix.from_indices(rng.integers(0, 300, 40000), 300)
    assert cpu.choose(few.structure, 48) == cpu.Strategy(
        "pull", "one piece (3000 rows, 5000 ids): the pull through the sort, same order", 1
    )
    assert cpu.choose(many.structure, 16).pieces == 4
    assert cpu.choose(many.structure, 16).kernel == "push"
    assert cpu.choose(many.structure, 16, feature_major=True).kernel == "push"
    assert cpu.choose(few.T.structure, 8).kernel == "gather"
    info = few.plan_info(48).strategies["forward, cpu"]
    assert info.startswith("native pull (one piece")
    text = jax.jit(lambda A, x: A @ x).lower(few, jnp.ones((5000, 48))).as_text()
    assert "jaxcsr_cpu_pull" in text and "jaxcsr_cpu_push" not in text
    sorted_ids = CSRMatrix.from_indices(np.sort(rng.integers(0, 30, 400)), 30)
    assert cpu.choose(sorted_ids.structure, 4).kernel == "pull"
    # one feature in one piece: the push (one sequential loop), two or more the pull
    assert cpu.choose(few.structure, 1) == cpu.Strategy(
        "push", "one piece (3000 rows, 5000 ids), one feature: the push", 1
    )
    assert cpu.choose(few.structure, 2).kernel == "pull"
    text = jax.jit(lambda A, x: A @ x).lower(few, jnp.ones((5000, 1))).as_text()
    assert "jaxcsr_cpu_push" in text and "jaxcsr_cpu_pull" not in text


@needs_native
@pytest.mark.parametrize("f", [2, 5, 7, 13, 24])  # 2-7, 9-15: fixed-width loops
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_one_piece_pull_and_push_give_the_same_bits(rng, dtype, f):
    """Unsorted ids in one piece, weighted and not, sum/max/min, jitted and under vmap:
    the pull jaxcsr chooses and the push reduce each row in input order."""
    m, k = 4000, 6000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    x = random_values(rng, (k, f)).astype(dtype)
    for data in (None, random_values(rng, k).astype(dtype)):
        A = CSRMatrix.from_indices(ids, m, data=data)
        results = {}
        for kernel in ("pull", "push"):
            with cpu.unsorted_kernel(kernel):
                fn = jax.jit(
                    lambda A, x: [jaxcsr.matmul(A, x, reduce=r) for r in ("sum", "max", "min")]
                )
                assert f"jaxcsr_cpu_{kernel}" in fn.lower(A, x).as_text()
                results[kernel] = [np.asarray(y) for y in fn(A, x)]
        reduces = ("sum", "max", "min")
        for y, z, reduce in zip(results["pull"], results["push"], reduces, strict=True):
            np.testing.assert_array_equal(y, z)
            want, _ = reduce_reference(A, np.asarray(x, np.float64), reduce)
            assert_close(y, want, dtype)


def test_gpu_rule_follows_the_h200_table(rng):
    """float32 sums over unsorted segment ids run the XLA path on CUDA; 16-bit, max/min,
    sorted ids and general matrices the kernel."""
    unsorted = CSRMatrix.from_indices(rng.integers(0, 50, 300), 50, backends=["xla"]).structure
    sorted_ids = CSRMatrix.from_indices(np.sort(rng.integers(0, 50, 300)), 50).structure
    general = CSRMatrix.from_coo(
        rng.integers(0, 50, 300), rng.integers(0, 60, 300), shape=(50, 60)
    ).structure
    f32, bf16 = np.dtype(np.float32), jnp.dtype(jnp.bfloat16)
    assert not gpu.default_for(unsorted, f32, "sum")
    assert gpu.default_for(unsorted, bf16, "sum")
    assert gpu.default_for(unsorted, f32, "max")
    assert gpu.default_for(sorted_ids, f32, "sum")
    assert gpu.default_for(general, f32, "sum")
    assert tpu.default_for(unsorted, f32, "sum")  # the TPU's rule reads the layout only


def test_profiles_reject_implausible_numbers():
    """Every field is bounded: a damaged or hand-edited file fails validation (and is
    measured again), never reaches a choice."""
    good = {"cpu": "x", "cores": 2, "l2_bytes": MiB, "l3_bytes": 32 * MiB}
    bad = [
        {"l3_bytes": -1},
        {"l3_bytes": 2**70},  # parses, but would overflow int64 in the gather's choice
        {"l2_bytes": 2**40},
        {"cores": 10**9},
        {"read_gbs": -5.0},
        {"copy_gbs": 0.0},
        {"write_gbs": float("inf")},
        {"call_floor_us": 1e12},
        {"read_gbs": "12.5"},
        {"read_gbs": None},
        {"cores": True},
        {"cpu": None},
    ]
    for change in bad:
        with pytest.raises(ValueError, match=f"MachineProfile: {next(iter(change))}"):
            machine.MachineProfile(**{**good, **change})
    assert np.isnan(machine.MachineProfile(**good).read_gbs)  # not measured: allowed


def _record(fields, measured_at=None, load=0.1):
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "profile": fields,
        "measured_at": (measured_at or now).isoformat(),
        "load": load,
    }


PLAUSIBLE = {
    "cpu": "synthetic",
    "cores": 2,
    "l2_bytes": MiB,
    "l3_bytes": 32 * MiB,
    "read_gbs": 10.0,
    "copy_gbs": 12.0,
    "write_gbs": 5.0,
    "call_floor_us": 9.0,
}


@pytest.mark.parametrize(
    "content",
    [
        json.dumps(_record({**PLAUSIBLE, "l3_bytes": 2**70})),
        json.dumps(_record({**PLAUSIBLE, "read_gbs": "fast"})),
        json.dumps(_record({**PLAUSIBLE, "read_gbs": None})),
        json.dumps(_record({**PLAUSIBLE, "l3_bytes": -4})),
        json.dumps(_record({**PLAUSIBLE, "call_floor_us": -1.0})),
        json.dumps(_record(PLAUSIBLE, load="high")),
        json.dumps({"profile": PLAUSIBLE, "date": "2026-12-01"}),  # an older version's file
        "[" * 100_000 + "]" * 100_000,  # nesting deep enough for a RecursionError
        "{not json",
    ],
    ids=[
        "l3-overflow",
        "read-string",
        "read-null",
        "l3-negative",
        "floor-negative",
        "load-string",
        "old-version",
        "deep-nesting",
        "not-json",
    ],
)
def test_an_invalid_file_is_measured_again(fresh, content):
    path = machine.cache_file()
    path.write_text(content)
    assert machine.stored(path) is None
    found = machine.profile()
    assert found.source == "measured"
    assert machine.stored(path) is not None  # replaced by the measurement
    if content != "{not json":
        return  # the command's reading of a replaced file: once (a process, 2 s)
    run = subprocess.run(
        [sys.executable, "-m", "jaxcsr.calibrate", "--show"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert str(path) in run.stdout and "--show stores nothing" in run.stdout


def test_a_stale_or_busy_profile_is_measured_again(fresh, monkeypatch):
    path = machine.cache_file()
    old = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=90)
    path.write_text(json.dumps(_record(PLAUSIBLE, measured_at=old)))
    assert "more than 30 days ago" in machine.stored(path).stale()
    assert machine.profile().source == "measured"

    # measured with the cores busy: trusted while the machine stays busy, measured
    # again once it is quiet
    path.write_text(json.dumps(_record(PLAUSIBLE, load=5.0)))
    monkeypatch.setattr(machine, "_load_average", lambda: 4.0)
    machine._forget()
    assert machine.profile().source == "file"
    monkeypatch.setattr(machine, "_load_average", lambda: 0.2)
    assert "under load 5.00" in machine.stored(path).stale()
    machine._forget()
    assert machine.profile().source == "measured"
    record = json.loads(path.read_text())
    assert record["load"] == 0.2 and record["measured_at"]


def test_show_reads_without_storing(fresh):
    path = machine.cache_file()
    run = subprocess.run(
        [sys.executable, "-m", "jaxcsr.calibrate", "--show"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "does not exist" in run.stdout and "--show stores nothing" in run.stdout
    assert not path.exists()


def test_the_cache_file_names_every_reported_field():
    """A process limited to fewer cores (taskset), or a machine differing in any cache
    size or model, reads its own file, never another's."""
    base = machine.MachineProfile("model A", cores=4, l2_bytes=MiB, l3_bytes=32 * MiB)
    changes = {"cpu": "model B", "cores": 2, "l2_bytes": 2 * MiB, "l3_bytes": 16 * MiB}
    names = {machine.cache_file(base).name}
    for field, value in changes.items():
        names.add(machine.cache_file(machine.dataclasses.replace(base, **{field: value})).name)
    assert len(names) == 1 + len(changes)
