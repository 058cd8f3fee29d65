"""Large outputs of the native kernels, and whether their memory was advised to use
huge pages: run as ``huge_pages.py OUT.json SEED`` under the environment to test
(``JAXCSR_HUGE_PAGES``; GLIBC_TUNABLES unset, so glibc advises nothing itself). Each
product's output is over 32 MiB, glibc's largest mmap threshold: fresh pages. Writes,
per product, a digest of the output's bytes and the VmFlags of the mapping holding its
middle."""

import hashlib
import json
import sys


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process holding ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def main() -> None:
    import jax
    import numpy as np

    import jaxcsr

    path, seed = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 20_000, 1_200_001).astype(np.int32)  # not a tile multiple
    ids[rng.random(ids.size) < 0.3] = 7  # one long row
    A = jaxcsr.CSRMatrix.from_indices(ids, num_rows=20_000)
    y = rng.uniform(-1, 1, (20_000, 16)).astype(np.float32)
    wide = jaxcsr.CSRMatrix.from_indices(rng.integers(0, 300_000, 400_000), num_rows=300_000)
    v = rng.uniform(-1, 1, (400_000, 32)).astype(np.float32)
    scores = rng.uniform(-4, 4, (ids.size, 8)).astype(np.float32)
    outputs = {
        "gather": jax.jit(lambda A, y: A.T @ y)(A, y),  # (E, 16): 77 MB
        "sum": jax.jit(lambda A, v: A @ v)(wide, v),  # (300k, 32): 38 MB
        "softmax": jax.jit(lambda s: jaxcsr.segment_softmax(s, ids, 20_000))(scores),
    }
    np.testing.assert_array_equal(np.asarray(outputs["gather"]), y[ids])  # a plain copy
    report = {}
    for name, out in outputs.items():
        out.block_until_ready()
        data = np.asarray(out)
        report[name] = {
            "digest": hashlib.sha256(data.tobytes()).hexdigest(),
            # the middle: the advice covers the whole 2 MiB pages inside the output
            "flags": vm_flags(out.unsafe_buffer_pointer() + data.nbytes // 2),
        }
    with open(path, "w") as file:
        json.dump(report, file)


if __name__ == "__main__":
    main()
