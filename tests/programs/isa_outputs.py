"""Every native product kind under the instruction set ``JAXCSR_CPU_ISA`` caps, saved to
``argv[1]`` (an ``.npz``) for the bit comparison across builds; ``argv[2]``: the seed."""


def main() -> None:
    import ctypes
    import functools
    import sys

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcsr
    from jaxcsr.kernels import cpu

    assert cpu.available(), cpu.library_path()

    # each jitted once per width, dtype and structure, the matrices closed over (host
    # structures): the compiles, not the kernels, are what take the time here
    def segment_products(these, rows_of, v, y):
        A = jaxcsr.CSRMatrix.from_indices(these, rows_of)
        outs = {r: jaxcsr.matmul(A, v, reduce=r) for r in ("sum", "max", "mean")}
        outs["gather"] = A.T @ y
        outs["last axis"] = v.T @ A.T
        outs["max grad"] = jax.grad(
            lambda v: jaxcsr.matmul(A, v, reduce="max").astype(jnp.float32).sum()
        )(v)
        outs["softmax"] = jaxcsr.segment_softmax(v, these, rows_of)
        return outs

    def general_products(G, x, ct):
        return {
            "max": jaxcsr.matmul(G, x, reduce="max"),
            "sum": G @ x,
            "vjp": jax.vjp(lambda x, d: G.with_data(d) @ x, x, G.data)[1](ct),
        }

    isa = ctypes.CDLL(str(cpu.library_path())).JaxcsrCpuIsa()
    rng = np.random.default_rng(int(sys.argv[2]))
    m, n, k = 37, 45, 3001
    ids = rng.integers(0, m, k)
    ids[: k // 2] = 5  # a hub
    few = rng.integers(0, 2000, k)
    rows, cols = rng.integers(0, m, k), rng.integers(0, n, k)
    outs = {}
    for dtype in (np.float32, jnp.bfloat16, np.float16):
        name = np.dtype(dtype).name
        G = jaxcsr.CSRMatrix.from_coo(
            rows, cols, rng.standard_normal(k).astype(np.float32), shape=(m, n)
        )
        G = G.with_data(G.data.astype(dtype))
        # 1 (eight lanes), 3, 12 and 19 (fixed-width loops), 16 and 64 (whole vectors),
        # 72 (past the vectors: the pull's blocks of 64, the push's loop over features)
        for f in (1, 3, 12, 16, 19, 64, 72):
            # unsorted ids with 1.5 a row reduce in one piece: the pull runs them
            for order, these, rows_of in (
                ("sorted", np.sort(ids), m),
                ("unsorted", ids, m),
                ("one piece", few, 2000),
            ):
                v = jnp.asarray(rng.standard_normal((k, f)), dtype)
                y = jnp.asarray(rng.standard_normal((rows_of, f)), dtype)
                products = jax.jit(functools.partial(segment_products, these, rows_of))
                for kind, out in products(v, y).items():
                    outs[f"{name} {f} {order} {kind}"] = out
            x = jnp.asarray(rng.standard_normal((n, f)), dtype)
            ct = jnp.asarray(rng.standard_normal((m, f)), dtype)
            for kind, out in jax.jit(functools.partial(general_products, G))(x, ct).items():
                outs[f"{name} {f} general {kind}"] = out
        # 2-8 heads: sorted rows (a few entries per vector, or a scalar loop at 5) and
        # unsorted ids (pushes of eight values across entries below 8 heads)
        for order, these in (("sorted", np.sort(ids)), ("unsorted", ids)):
            for heads in (2, 4, 5, 8):
                v = jnp.asarray(rng.standard_normal((k, heads)), dtype)
                out, vjp = jax.vjp(lambda v, these=these: jaxcsr.segment_softmax(v, these, m), v)
                outs[f"{name} {heads} heads {order} softmax"] = out
                outs[f"{name} {heads} heads {order} softmax grad"] = vjp(out)[0]
    leaves = jax.tree_util.tree_leaves_with_path(outs)  # the VJP's pair: two leaves
    np.savez(
        sys.argv[1],
        isa=isa,
        **{jax.tree_util.keystr(path): np.asarray(v, np.float32) for path, v in leaves},
    )
    print("ok")


if __name__ == "__main__":
    main()
