"""Float64 products and reductions with JAX_ENABLE_X64 (set before jax is imported)."""


def main() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.test_util import check_grads

    import jaxcsr
    from jaxcsr import CSRMatrix

    assert jax.config.jax_enable_x64
    rng = np.random.default_rng(0)
    ALL = ("xla", "pallas_gpu", "pallas_tpu")
    idx = rng.integers(0, 7, 60)
    A = CSRMatrix.from_indices(idx, num_rows=7, backends=ALL)
    x32 = rng.uniform(-2, 2, (60, 3)).astype(np.float32)
    for reduce in ("max", "min"):
        # the x64 default dtype used to leak into the GPU kernel's output buffer
        out = jaxcsr.matmul(A, jnp.asarray(x32), reduce=reduce, impl="pallas_gpu", interpret=True)
        ref = jaxcsr.matmul(A, jnp.asarray(x32), reduce=reduce, impl="xla")
        assert out.dtype == np.float32, out.dtype
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        seg = jaxcsr.segment_max if reduce == "max" else jaxcsr.segment_min
        np.testing.assert_array_equal(np.asarray(seg(jnp.asarray(x32), idx, 7)), np.asarray(ref))
    # float64 mean/max/min and their gradients against float64 numpy
    x = rng.uniform(-2, 2, (60, 3))
    for reduce in ("mean", "max", "min"):
        out = np.asarray(jaxcsr.matmul(A, jnp.asarray(x), reduce=reduce))
        assert out.dtype == np.float64
        for r in range(7):
            rows = x[idx == r]
            want = {"mean": rows.mean(0), "max": rows.max(0), "min": rows.min(0)}[reduce]
            np.testing.assert_allclose(out[r], want if len(rows) else 0.0, rtol=1e-12)
        check_grads(lambda v: jaxcsr.matmul(A, v, reduce=reduce), (jnp.asarray(x),), 1, eps=1e-6)
    print("ok")


if __name__ == "__main__":
    main()
