"""Every native kernel on random structures, run against the sanitizer build
(``JAXCSR_CPU_LIBRARY``); ``argv[1]``: the seed."""


def main() -> None:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxcsr
    from jaxcsr.kernels import cpu

    assert cpu.available(), cpu.library_path()
    rng = np.random.default_rng(int(__import__("sys").argv[1]))

    def all_products(A, G, v, x, y, ct_rows, ids, reduce):
        """Every product of a trial's matrices at one dtype and width; jitted with the
        matrices closed over (host structures, as outside jit), one program per width
        and dtype: the compiles, not the kernels, are what take the time here."""
        m = A.shape[0]
        Gd = G.with_data(G.data.astype(v.dtype))
        return (
            jaxcsr.matmul(A, v, reduce=reduce),
            jaxcsr.matmul(Gd, x, reduce=reduce),
            # the pull's own mean: float32 sums of 16-bit values, then rounded (MeanRows)
            jaxcsr.matmul(Gd, x, reduce="mean"),
            Gd.T @ y,
            # the planned transpose's values through t_perm (both layouts)
            jax.grad(lambda x: jnp.sum(Gd @ x))(x),
            y.T @ Gd,
            A.T @ y,  # one entry per row: the gather
            jaxcsr.segment_sum(v, ids, max(m - 1, 1)),  # traced ids: some dropped
            jaxcsr.sddmm(Gd, ct_rows, x),
            jaxcsr.sddmm(A.T, v, ct_rows),
            # the arg search: first columns (pieces), CSR positions (rows)
            jaxcsr.matmul(A, v, reduce="max", return_arg=True),
            jaxcsr.matmul(Gd, x, reduce="min", return_arg=True),
            # the max's gradient: the search, then the put at its columns
            jax.grad(lambda v: jnp.sum(jaxcsr.matmul(A, v, reduce="max").astype(jnp.float32)))(v),
        )

    for trial in range(4):
        m, n, k = rng.integers(1, 40), rng.integers(1, 60), rng.integers(0, 500)
        ids = rng.integers(0, m, k)
        if trial % 2 == 0:
            ids[: k // 2] = m // 2  # a hub
        A = jaxcsr.CSRMatrix.from_indices(np.sort(ids) if trial % 3 == 0 else ids, int(m))
        rows, cols = rng.integers(0, m, k), rng.integers(0, n, k)
        G = jaxcsr.CSRMatrix.from_coo(
            rows, cols, rng.standard_normal(k).astype(np.float32), shape=(int(m), int(n))
        )
        products = jax.jit(functools.partial(all_products, A, G), static_argnames="reduce")
        for dtype in (np.float32, jnp.bfloat16, np.float16):
            # one feature, 4 or 3 (the softmax's few-heads loops), and a width per trial:
            # 33 (a loop over features), 16 and 64 (whole vectors; sixteen softmax lanes
            # with AVX-512), 136 (pull blocks: 64 + 64 + 8)
            for f in (1, (4, 3)[trial % 2], (33, 16, 64, 136)[trial]):
                v = jnp.asarray(rng.standard_normal((k, f)), dtype)
                x = jnp.asarray(rng.standard_normal((n, f)), dtype)
                y = jnp.asarray(rng.standard_normal((m, f)), dtype)
                ct_rows = jnp.asarray(rng.standard_normal((m, f)), dtype)
                reduce = ("sum", "max", "min")[(trial + f) % 3]
                jax.block_until_ready(products(v, x, y, ct_rows, ids, reduce=reduce))
                if dtype != (np.float32, jnp.bfloat16, np.float16)[trial % 3]:
                    continue  # the rest on one dtype per trial (each jit is slow here)
                # feature-major (values @ B): push or pull, the gather, a general pull
                out = (
                    jax.vjp(lambda w: w @ A.T, v.T)[1](y.T),
                    y.T @ G.with_data(G.data.astype(dtype)),
                )
                jax.block_until_ready(out)
                # the fused softmax and its backward: unsorted/sorted ids (both branches:
                # + 100 overflows the unshifted sums), traced ids with some dropped, CSR patterns
                dropped = jnp.asarray(np.where(rng.random(k) < 0.2, m + 2, ids))
                traced_softmax = jax.jit(lambda s, i: jaxcsr.segment_softmax(s, i, int(m)))
                for fn, s in (
                    (lambda s: jaxcsr.segment_softmax(s, ids, int(m)), v),
                    (lambda s: jaxcsr.segment_softmax(s, ids, int(m)), v + 100),
                    (lambda s: traced_softmax(s, dropped), v),
                    (
                        lambda s: jaxcsr.edge_softmax(G, s),
                        jnp.asarray(rng.standard_normal((G.nnz, f)), dtype),
                    ),
                ):
                    out, vjp = jax.vjp(fn, s)
                    jax.block_until_ready((out, vjp(s)))
    print("ok")


if __name__ == "__main__":
    main()
