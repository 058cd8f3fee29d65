"""Timed choices between the CPU kernels that give a one-piece sum's bits
(jaxcsr.timed_choices): what is timed, stored and read back, and that every
candidate computes the same bits, so the choice never changes a result."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, power_law_ids, random_values, reduce_reference

from jaxcsr import CSRMatrix, calibrate
from jaxcsr import timed_choices as tc
from jaxcsr.kernels import cpu

if not cpu.available():
    if os.environ.get("JAXCSR_REQUIRE_CPU_KERNELS") == "1":
        raise RuntimeError("JAXCSR_REQUIRE_CPU_KERNELS=1 but the CPU library is not built")
    pytest.skip("the CPU library is not built (no C++17 compiler?)", allow_module_level=True)

# A one-piece class whose rule is the pull (4 features under NARROW_SCATTER_MIN_IDS
# ids: the scatter rule starts there) and which timed_choices times (2^15 values or more).
M, K, F = 24000, 40000, 4
PUSH_FASTEST = {"push": 10, "pull": 90, "xla": 90}
# the class's size: the quarter powers of two nearest M and K
CLASS_ROWS, CLASS_IDS = round(2**14.5), round(2**15.25)
KERNEL_CALL = {"push": "jaxcsr_cpu_push", "pull": "jaxcsr_cpu_pull", "xla": None}


@pytest.fixture
def timed(tmp_path, monkeypatch):
    """Timed choices on, stored under tmp_path, nothing read into the process yet."""
    monkeypatch.setenv("JAXCSR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("JAXCSR_TIMED_CHOICES", "1")
    monkeypatch.delenv("JAXCSR_CALIBRATE", raising=False)
    tc._forget()
    yield tmp_path
    tc._forget()


def fake_times(times: dict[str, float], calls: list):
    """A stand-in for cpu._time_one_piece returning ``times`` (us), recording each call."""

    def fake(rows, ids, n_features, itemsize, kernels):
        calls.append((rows, ids, n_features, itemsize, tuple(kernels)))
        return {k: times[k] for k in kernels}

    return fake


def runs(B, x) -> str:
    """Which kernel the compiled product runs: a native call, or XLA's scatter."""
    text = jax.jit(lambda B, x: B @ x).lower(B, x).as_text()
    for kernel, call in KERNEL_CALL.items():
        if call is not None and call in text:
            return kernel
    assert "scatter" in text, "neither a native call nor XLA's scatter"
    return "xla"


def problem(rng, k=K, m=M, f=F):
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    x = jnp.asarray(random_values(rng, (k, f)))
    return A, x


def test_the_rule_decides_without_timed_choices(rng, timed, monkeypatch):
    monkeypatch.setenv("JAXCSR_TIMED_CHOICES", "0")
    calls: list = []
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times({"push": 1, "pull": 9, "xla": 9}, calls))
    A, x = problem(rng)
    assert cpu.push_pieces(M, K, F, 4) == 1
    assert runs(A, x) == "pull" and not calls
    assert not tc.choices_file().exists()


def test_a_faster_candidate_is_chosen_stored_and_read_back(rng, timed, monkeypatch):
    calls: list = []
    times = {"push": 50, "pull": 200, "xla": 120}
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times(times, calls))
    A, x = problem(rng)
    assert runs(A, x) == "push"
    # timed once, at the class's size
    assert calls == [(CLASS_ROWS, CLASS_IDS, F, 4, ("push", "pull", "xla"))]
    y = np.asarray(jax.jit(lambda B, x: B @ x)(A, x))
    assert_close(y, reduce_reference(A, np.asarray(x, np.float64), "sum")[0], np.float32)
    info = A.plan_info(F).strategies["forward, cpu"]
    assert "timed on this machine" in info and "rule: pull" in info and "push 50 us" in info
    record = json.loads(tc.choices_file().read_text())
    key = tc.shape_class(M, K, F, 4)
    assert record["choices"][key]["kernel"] == "push"
    assert record["choices"][key]["rule"] == "pull"
    # another process (nothing read yet) reads the file and times nothing
    tc._forget()
    monkeypatch.setattr(cpu, "_time_one_piece", lambda *a: pytest.fail("timed again"))
    other, x2 = problem(rng, k=K + 999, m=M - 777)  # the same class
    assert tc.shape_class(M - 777, K + 999, F, 4) == key
    assert runs(other, x2) == "push"
    assert key in tc.stored()


def test_the_rule_stays_unless_another_is_faster_by_the_margin(rng, timed, monkeypatch):
    calls: list = []
    just_under = 200 * (1 - tc.MARGIN) * 1.02
    times = {"push": just_under, "pull": 200, "xla": 250}
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times(times, calls))
    A, x = problem(rng)
    assert runs(A, x) == "pull" and len(calls) == 1
    assert tc.stored()[tc.shape_class(M, K, F, 4)].kernel == "pull"


def test_what_is_timed_and_what_is_not(rng, timed, monkeypatch):
    calls: list = []
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times({"push": 1, "pull": 9, "xla": 9}, calls))
    assert tc.candidates(1, 4) == ("push", "xla")  # the pull: eight lanes at F = 1
    assert tc.candidates(4, 2) == ("push", "pull")  # 16-bit: no scatter
    ids = power_law_ids(rng, K, M)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, M)
    not_timed = [
        (A.structure, 32, 4, "sum"),  # past MAX_FEATURES
        (A.structure, F, 4, "max"),  # only sums
        (CSRMatrix.from_indices(ids[:4000], M).structure, F, 4, "sum"),  # too few values
        (CSRMatrix.from_indices(np.sort(ids), M).structure, F, 4, "sum"),  # sorted: the pull
        (CSRMatrix.from_indices(ids % 500, 500).structure, F, 4, "sum"),  # 4 pieces: the push
    ]
    for structure, f, itemsize, reduce in not_timed:
        rule = cpu.choose(structure, f, itemsize, reduce=reduce).kernel
        assert "timed" not in cpu.choose(structure, f, itemsize, reduce=reduce).reason
        assert rule in ("pull", "push")
    assert not calls
    with cpu.unsorted_kernel("pull"):  # a pin wins over timings
        assert cpu.choose(A.structure, F).kernel == "pull" and not calls
    assert cpu.choose(A.structure, F, 2).kernel == "push"  # 16-bit, timed: push
    assert calls == [(CLASS_ROWS, CLASS_IDS, F, 2, ("push", "pull"))]


def test_calibration_off_reads_stored_choices_but_times_none(rng, timed, monkeypatch):
    monkeypatch.setenv("JAXCSR_CALIBRATE", "0")
    monkeypatch.setattr(
        cpu, "_time_one_piece", lambda *a: pytest.fail("timed with calibration off")
    )
    A, x = problem(rng)
    assert runs(A, x) == "pull"  # nothing stored: the rule
    monkeypatch.delenv("JAXCSR_CALIBRATE")
    calls: list = []
    monkeypatch.setattr(
        cpu, "_time_one_piece", fake_times({"push": 10, "pull": 90, "xla": 90}, calls)
    )
    assert cpu.choose(A.structure, F).kernel == "push" and len(calls) == 1
    monkeypatch.setenv("JAXCSR_CALIBRATE", "0")
    tc._forget()
    assert cpu.choose(A.structure, F).kernel == "push" and len(calls) == 1


def test_choices_of_another_build_or_too_old_are_timed_again(rng, timed, monkeypatch):
    calls: list = []
    monkeypatch.setattr(
        cpu, "_time_one_piece", fake_times({"push": 10, "pull": 90, "xla": 90}, calls)
    )
    A, _ = problem(rng)
    assert cpu.choose(A.structure, F).kernel == "push" and len(calls) == 1
    path = tc.choices_file()
    record = json.loads(path.read_text())
    key = tc.shape_class(M, K, F, 4)
    for damage in ("another build", "too old", "not a number"):
        changed = json.loads(json.dumps(record))
        if damage == "another build":
            changed["library"] = "0" * 16
        elif damage == "too old":
            changed["choices"][key]["measured_at"] = "2020-01-01T00:00:00+00:00"
        else:
            changed["choices"][key]["times_us"]["push"] = "fast"
        path.write_text(json.dumps(changed))
        tc._forget()
        before = len(calls)
        assert cpu.choose(A.structure, F).kernel == "push" and len(calls) == before + 1, damage


def test_calibrate_drops_stored_choices(rng, timed, monkeypatch, capsys):
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times({"push": 10, "pull": 90, "xla": 90}, []))
    A, _ = problem(rng)
    cpu.choose(A.structure, F)
    calibrate.main(["--show"])
    assert "push (rule: pull" in capsys.readouterr().out
    assert tc.choices_file().exists()
    calibrate.main([])
    assert not tc.choices_file().exists()
    assert "removed" in capsys.readouterr().out


@pytest.mark.parametrize("f", [1, 2, 3, 8, 16])
def test_every_candidate_gives_the_same_bits(rng, f):
    """The promise the timed choice rests on: in one piece the candidates add each
    row's values in input order (weighted or not; skewed rows, empty rows), so
    whichever is timed fastest, the result's bits are the same."""
    m, k = 3001, 8000
    ids = power_law_ids(rng, k, m)
    rng.shuffle(ids)
    A = CSRMatrix.from_indices(ids, m)
    W = A.with_data(jnp.asarray(random_values(rng, (k,))))
    assert np.bincount(ids, minlength=m).min() == 0
    assert cpu.push_pieces(m, k, f, 4) == cpu.push_pieces(m, k, f, 2) == 1
    for B in (A, W):
        for dtype in (np.float32, jnp.bfloat16):
            itemsize = np.dtype(dtype).itemsize
            x = jnp.asarray(random_values(rng, (k, f))).astype(dtype)
            results = {}
            for kernel in tc.candidates(f, itemsize):
                with tc.pin(kernel):
                    assert runs(B, x) == kernel
                    results[kernel] = np.asarray(jax.jit(lambda B, x: B @ x)(B, x))
            first = next(iter(results.values()))
            for kernel, y in results.items():
                np.testing.assert_array_equal(first, y, err_msg=f"{kernel}, {dtype}")
            x64 = np.asarray(x.astype(jnp.float32), np.float64)
            assert_close(first, reduce_reference(B, x64, "sum")[0], dtype)


def test_a_real_timing_stores_positive_times_and_keeps_the_bits(rng, timed, monkeypatch):
    """Timed for real (about a second): every candidate gets a time, the choice is one
    of them, and the product's bits are those of the rule's kernel."""
    A, x = problem(rng)
    with monkeypatch.context() as m:
        m.setenv("JAXCSR_TIMED_CHOICES", "0")
        by_rule = np.asarray(jax.jit(lambda B, x: B @ x)(A, x))
    y = np.asarray(jax.jit(lambda B, x: B @ x)(A, x))
    found = tc.stored()[tc.shape_class(M, K, F, 4)]
    assert set(found.times_us) == {"push", "pull", "xla"}
    assert all(t > 0 for t in found.times_us.values()) and found.kernel in found.times_us
    assert found.rule == "pull" and (found.rows, found.ids) == (CLASS_ROWS, CLASS_IDS)
    np.testing.assert_array_equal(y, by_rule)


def test_a_failed_timing_warns_once_and_leaves_the_rule(rng, timed, monkeypatch):
    def broken(*args):
        raise RuntimeError("no timer here")

    monkeypatch.setattr(cpu, "_time_one_piece", broken)
    A, x = problem(rng)
    with pytest.warns(UserWarning, match="no timer here"):
        assert runs(A, x) == "pull"
    calls: list = []
    monkeypatch.setattr(cpu, "_time_one_piece", fake_times(PUSH_FASTEST, calls))
    assert cpu.choose(A.structure, F).kernel == "pull" and not calls  # not again
    assert not tc.choices_file().exists()
