"""The package without its built library: products fall back to XLA with one warning;
impl="cpu" raises. Run with PYTHONPATH at a copy of the package without its ``.so``."""


def main() -> None:
    import warnings

    import numpy as np

    import jaxcsr
    from jaxcsr.kernels import cpu

    assert not cpu.available() and cpu.library_path() is None
    A = jaxcsr.CSRMatrix.from_indices(np.array([0, 2, 2, 1]), 3)
    assert "cpu" in A.backends
    v = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two products, one warning
            y = np.asarray(A @ v)
    np.testing.assert_array_equal(y, [[0, 1], [6, 7], [6, 8]])
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "compiled CPU library" in messages[0], messages
    try:
        jaxcsr.matmul(A, v, impl="cpu")
    except RuntimeError as err:
        assert "impl='cpu' cannot run" in str(err), err
    else:
        raise AssertionError("impl='cpu' ran without its library")
    print("ok")


if __name__ == "__main__":
    main()
