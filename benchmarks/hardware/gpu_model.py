"""A bandwidth/latency model of the GPU kernels -- estimates, not measurements.

``python -m benchmarks.hardware.gpu_model [--shared ../shared/data]`` prints, for the
previous (atomic) Triton kernel and the current two-pass kernel, on twitter_ego's
segment form, law_cnr2000_sym and the 1-24-segment reduction at F = 16/64/256: bytes
moved, programs, the longest dependent chain of memory latencies (summed over the passes, which
run one after another),
lane utilisation, and a time estimate ``max(bytes / bandwidth, latency-bound
time)`` as a fraction of the copy bandwidth. The table is in ``docs/gpu.md``.

Assumptions (constants below): H200 copy bandwidth 4.3 TB/s (measured on the lent
machine kind, device library KINDS.md), 0.6 us per dependent global-memory round trip
under load, 132 SMs, programs per SM from the register counts of the SASS check,
every gathered row of X read from DRAM (no cache reuse: pessimistic for graphs whose
X fits in the 60 MB L2), f32 operands, no matrix values.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from jaxcsr.kernels import gpu

BANDWIDTH = 4.3e12
LATENCY = 0.6e-6
SMS = 132
MAX_WARPS_PER_SM = 64
REGISTERS_PER_SM = 65536
OLD_CHUNK, OLD_ITEMS_PER_PROGRAM = 32, 4
OLD_REGISTERS = 28  # SASS check of the previous kernel: 26-29
NEW_REGISTERS = 80  # SASS check of this kernel: 48-94 (docs/gpu.md)
OLD_LATENCIES_PER_4_NONZEROS = 2  # index load -> row load, after ptxas unrolls by 4
FENCED_ATOMIC_LATENCIES = 2  # MEMBAR.GPU + the atomic's round trip


@dataclasses.dataclass(frozen=True)
class Estimate:
    kernel: str
    bytes: float
    programs: int
    longest_chain: int
    utilisation: float
    seconds: float

    @property
    def pct_bandwidth(self) -> float:
        return 100 * self.bytes / self.seconds / BANDWIDTH


def _slots(registers: int, warps: int) -> int:
    """Concurrent programs on the whole GPU."""
    per_sm = min(MAX_WARPS_PER_SM // warps, REGISTERS_PER_SM // (registers * 32 * warps))
    return SMS * max(per_sm, 1)


def _time(bytes_, chains, slots) -> float:
    """Bandwidth-bound or latency-bound, whichever is slower (greedy: total chain
    length spread over the concurrent programs, at least the longest chain)."""
    latency = max(np.sum(chains) / slots, np.max(chains, initial=0)) * LATENCY
    return max(bytes_ / BANDWIDTH, latency)


def old_kernel(indptr: np.ndarray, F: int, b: int = 4) -> Estimate:
    """The previous kernel: atomic work items of <= 32 nonzeros, 4 per program."""
    lengths = np.diff(indptr)
    nnz, m = int(indptr[-1]), lengths.size
    pieces = -(-lengths // OLD_CHUNK)
    items = np.concatenate(
        [
            np.minimum(OLD_CHUNK, L - OLD_CHUNK * np.arange(p))
            for L, p in zip(lengths, pieces, strict=True)
            if p
        ]
    )
    pad = (-items.size) % OLD_ITEMS_PER_PROGRAM
    per_program = np.concatenate([items, np.zeros(pad, int)]).reshape(-1, OLD_ITEMS_PER_PROGRAM)
    block_n = min(128, max(16, 1 << (F - 1).bit_length()))
    blocks = -(-F // block_n)
    padded_f = blocks * block_n
    warps = {16: 1, 32: 1, 64: 2, 128: 4}[block_n]
    # per item: item arrays (1) + 2 per 4 nonzeros + the fenced atomic
    chains = (
        1 + OLD_LATENCIES_PER_4_NONZEROS * -(-per_program // 4) + FENCED_ATOMIC_LATENCIES
    ).sum(axis=1)
    chains = np.repeat(chains, blocks)
    bytes_ = (
        nnz * (F * b + 4)  # gathered rows + indices
        + 12 * items.size  # item arrays
        + m * padded_f * 4  # zero-initialised float32 output
        + items.size * padded_f * 8  # atomic read-modify-write per item
        + m * padded_f * 4
        + m * F * b  # cast pass
    )
    return Estimate(
        "atomic (previous)",
        bytes_,
        chains.size,
        int(chains.max(initial=0)),
        1.0,
        _time(bytes_, chains, _slots(OLD_REGISTERS, warps)),
    )


def new_kernel(indptr: np.ndarray, F: int, b: int = 4) -> Estimate:
    """This kernel: pass 1 over chunks of long rows, pass 2 writes every row once."""
    import jax.numpy as jnp

    lanes = gpu.plan_lanes(indptr)
    cfg = gpu.tile_config(F, jnp.float32 if b == 4 else jnp.bfloat16)
    blocks = -(-F // cfg.block_n)
    m = indptr.size - 1
    num_short = int(lanes.num_short[0])
    chunk_len = (lanes.chunk_end - lanes.chunk_start).astype(np.int64)
    chunk_len = chunk_len[chunk_len > 0]
    short_len = (lanes.end - lanes.start)[:num_short].astype(np.int64)
    partials = (lanes.end - lanes.start)[num_short:].astype(np.int64)

    def programs(lengths):
        pad = (-lengths.size) % cfg.block_m
        return np.concatenate([lengths, np.zeros(pad, np.int64)]).reshape(-1, cfg.block_m)

    group_len = (lanes.group_end - lanes.group_start).astype(np.int64)
    group_len = group_len[group_len > 0]
    p1, p1b, p2 = programs(chunk_len), programs(group_len), programs(short_len)
    chain1 = 1 + 2 * -(-p1.max(axis=1, initial=0) // cfg.block_k)
    chain1b = 1 + -(-p1b.max(axis=1, initial=0) // cfg.block_k)  # contiguous: no index load
    chain2 = 1 + 2 * -(-p2.max(axis=1, initial=0) // cfg.block_k)
    chain_long = 1 + -(-partials // (cfg.block_k * cfg.block_m))
    bytes1 = chunk_len.sum() * (F * b + 4) + 8 * chunk_len.size + chunk_len.size * F * 4
    bytes1b = group_len.sum() * F * 4 + 8 * group_len.size + group_len.size * F * 4
    bytes2 = short_len.sum() * (F * b + 4) + 12 * m + partials.sum() * F * 4 + m * F * b
    slots = _slots(NEW_REGISTERS, cfg.num_warps)
    t1 = _time(bytes1, np.repeat(chain1, blocks), slots) if chunk_len.size else 0.0
    t1b = _time(bytes1b, np.repeat(chain1b, blocks), slots) if group_len.size else 0.0
    t2 = _time(bytes2, np.repeat(np.concatenate([chain2, chain_long]), blocks), slots)
    used = short_len.sum() + chunk_len.sum()
    issued = (p2.max(axis=1, initial=0).sum() + p1.max(axis=1, initial=0).sum()) * cfg.block_m
    chains = (chain1, chain1b, chain2, chain_long)
    return Estimate(
        "two-pass (this)",
        bytes1 + bytes1b + bytes2,
        (p1.shape[0] + p1b.shape[0] + p2.shape[0] + partials.size) * blocks,
        int(sum(c.max(initial=0) for c in chains)),  # the passes run one after another
        float(used / issued) if issued else 1.0,
        t1 + t1b + t2,
    )


def cases(shared: Path) -> dict[str, np.ndarray]:
    """Row pointers of the modelled structures (segment form: rows = destinations)."""
    out = {}
    twitter = shared / "twitter_ego.npz"
    if twitter.exists():
        dst = np.load(twitter)["edges"][1]
        out["twitter_ego (segment)"] = np.concatenate([[0], np.cumsum(np.bincount(dst))])
    law = shared / "matrices" / "law_cnr2000_sym.npz"
    if law.exists():
        out["law_cnr2000_sym"] = sp.load_npz(law).tocsr().indptr.astype(np.int64)
    rng = np.random.default_rng(0)
    for k in (1, 24):
        ids = rng.integers(0, k, 400_000)
        out[f"{k} segment(s), 400k values"] = np.concatenate([[0], np.cumsum(np.bincount(ids))])
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared", type=Path, default=Path("../shared/data"))
    parser.add_argument("--features", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args(argv)
    rows = []
    print(
        "| structure | F | kernel | MB moved | programs | longest chain | lane util. "
        "| est. time (us) | est. % of copy BW |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, indptr in cases(args.shared).items():
        for F in args.features:
            for est in (old_kernel(indptr, F), new_kernel(indptr, F)):
                rows.append({"structure": name, "F": F, **dataclasses.asdict(est)})
                print(
                    f"| {name} | {F} | {est.kernel} | {est.bytes / 1e6:.1f} | {est.programs} "
                    f"| {est.longest_chain} | {est.utilisation:.2f} | {est.seconds * 1e6:.0f} "
                    f"| {est.pct_bandwidth:.0f} |"
                )
    return rows


if __name__ == "__main__":
    main()
