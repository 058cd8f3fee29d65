"""A jax without the Pallas Triton backend: impl=None on CUDA lowers to the XLA path with
one warning; impl="pallas_gpu" raises."""


def main() -> None:
    import sys
    import warnings

    sys.modules["jax.experimental.pallas.triton"] = None  # what a jax without it raises
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import export

    import jaxcsr
    from jaxcsr.kernels import gpu

    assert not gpu.available()
    A = jaxcsr.CSRMatrix.from_indices(np.array([0, 2, 2, 1]), 3, backends=["xla", "pallas_gpu"])
    spec = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two products, one warning
            text = export.export(
                jax.jit(lambda v: A @ v), platforms=["cuda"], disabled_checks=checks
            )(spec).mlir_module()
            assert "__gpu$xla.gpu.triton" not in text
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "run on the fallback, 'xla'" in messages[0], messages
    try:
        jaxcsr.matmul(A, jnp.ones((4, 8)), impl="pallas_gpu", interpret=True)
    except RuntimeError as err:
        assert "impl='pallas_gpu' cannot run" in str(err) and "Pallas" in str(err), err
    else:
        raise AssertionError("impl='pallas_gpu' ran without Pallas Triton")
    print("ok")


if __name__ == "__main__":
    main()
