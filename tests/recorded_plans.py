"""Kernel plans recorded from fixed structures, and the structures themselves.

``tests/data/recorded_plans.npz`` holds, for each case of :func:`cases`, its CSR input
and the GPU lanes and TPU schedules planned from it (both orientations, with and
without the column-reuse estimate, default and small tilings). It was written by the
planners of 73f3e00 -- the separate host and device planners, which tests had proved
equal -- before they became one planner per backend; ``tests/test_plan.py`` and
``tests/test_traced.py`` hold today's planner to it, on the host and under ``jit``.
Rewrite it (``python -m tests.recorded_plans``) only for a deliberate plan change,
and say so in the commit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

PATH = Path(__file__).parent / "data" / "recorded_plans.npz"
LANE_FIELDS = ("row", "start", "end", "num_short", "chunk_start", "chunk_end")
LANE_FIELDS += ("group_start", "group_end")
TILE_FIELDS = ("block", "tile", "span")
SMALL_TILING = (256, 16, 64)
"""``tpu.Tiling(block_k, window, block_m)`` small enough for many steps at test sizes."""


def _power_law_ids(rng, size: int, rows: int) -> np.ndarray:
    weights = 1.0 / np.arange(1, rows + 1) ** 1.1
    return rng.choice(rows, size=size, p=weights / weights.sum()).astype(np.int32)


def cases() -> dict[str, dict[str, np.ndarray]]:
    """The recorded inputs: segment ids (``ids``, ``num_rows``) or COO (``row``,
    ``col``, ``shape``). Generated once; the file keeps them, so later numpy versions
    drawing other numbers change nothing."""
    rng = np.random.default_rng(20261206)
    hub = np.where(np.arange(5000) % 10 == 0, np.arange(5000) % 7, 3)
    few = rng.choice(rng.choice(300, size=20), size=900)
    out = {
        "power_law": {"ids": _power_law_ids(rng, 3000, 700), "num_rows": 700},
        "hub": {"ids": hub, "num_rows": 7},  # > 64 * 64 in one row: group lanes
        "sorted": {"ids": np.sort(_power_law_ids(rng, 2500, 333)), "num_rows": 333},
        "few_rows": {"ids": few, "num_rows": 300},
        "duplicates": {"ids": np.array([4, 4, 0, 4, 2]), "num_rows": 6},
        "no_entries": {"ids": np.zeros(0, np.int32), "num_rows": 5},
    }
    m, n = 150, 90
    out["general"] = {  # skewed rows, repeated columns and duplicate coordinates
        "row": _power_law_ids(rng, 4000, m),
        "col": _power_law_ids(rng, 4000, n),
        "shape": np.array([m, n]),
    }
    out["general_hub"] = {
        "row": hub[:4500],
        "col": rng.integers(0, 40, 4500),
        "shape": np.array([7, 40]),
    }
    lengths = np.where(np.arange(400) % 2 == 0, 6, 14)  # banded: reuse flips the order
    out["banded"] = {
        "row": np.repeat(np.arange(400), lengths),
        "col": np.concatenate([i + np.arange(k) for i, k in enumerate(lengths)]),
        "shape": np.array([400, 440]),
    }
    for case in out.values():
        for key in ("ids", "row", "col"):
            if key in case:
                case[key] = np.asarray(case[key], np.int32)
    return out


def structure_of(case: dict[str, np.ndarray]):
    """The host :class:`~jaxcsr.structure.Structure` of a recorded case."""
    from jaxcsr import plan

    if "ids" in case:
        return plan.structure_from_segment_ids(case["ids"], int(case["num_rows"]))
    shape = tuple(int(s) for s in case["shape"])
    indptr, indices, _ = plan.coo_to_csr(case["row"], case["col"], shape)
    return plan.general_structure(indptr, indices, shape)


def kernel_plans(structure) -> dict[str, np.ndarray]:
    """Every plan array of the GPU and TPU planners for a host structure, by name."""
    from jaxcsr.kernels import gpu, tpu

    out: dict[str, np.ndarray] = {}

    def put(prefix, obj, fields):
        for name in fields:
            out[f"{prefix}/{name}"] = np.asarray(getattr(obj, name))

    g = gpu.plan(structure)
    put("gpu/lanes", g.lanes, LANE_FIELDS)
    put("gpu/plain_lanes", gpu.plan_lanes(np.asarray(structure.indptr)), LANE_FIELDS)
    t = tpu.plan(structure)
    put("tpu/tiles", t.tiles, TILE_FIELDS)
    out["tpu/rows"] = np.asarray(t.rows)
    small = tpu.plan_schedule(structure.indptr, tpu.Tiling(*SMALL_TILING))
    put("tpu/small_tiles", small, TILE_FIELDS)
    if structure.t_indptr is not None:
        put("gpu/t_lanes", g.t_lanes, LANE_FIELDS)
        put("gpu/plain_t_lanes", gpu.plan_lanes(np.asarray(structure.t_indptr)), LANE_FIELDS)
        put("tpu/t_tiles", t.t_tiles, TILE_FIELDS)
        out["tpu/t_rows"] = np.asarray(t.t_rows)
    return out


def load() -> dict[str, dict[str, np.ndarray]]:
    """``{case: {"input/<key>" | "<plan array>": array}}`` from :data:`PATH`."""
    out: dict[str, dict[str, np.ndarray]] = {}
    with np.load(PATH) as data:
        for key in data.files:
            case, rest = key.split("/", 1)
            out.setdefault(case, {})[rest] = data[key]
    return out


def inputs(recorded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The input arrays of one loaded case."""
    return {k[len("input/") :]: v for k, v in recorded.items() if k.startswith("input/")}


def record() -> None:
    arrays = {}
    for name, case in cases().items():
        for key, value in case.items():
            arrays[f"{name}/input/{key}"] = np.asarray(value)
        for key, value in kernel_plans(structure_of(case)).items():
            arrays[f"{name}/{key}"] = value
    PATH.parent.mkdir(exist_ok=True)
    np.savez_compressed(PATH, **arrays)


if __name__ == "__main__":
    record()
