"""Builds jaxcsr's native CPU kernels (jaxcsr/kernels/csrc) as a plain shared library.

Everything else is in pyproject.toml. The library is optional: without a C++17
compiler or jaxlib's XLA FFI headers the build step only warns, the install
succeeds, and products run on the XLA path (jaxcsr.kernels.cpu.available() is False).
``JAXCSR_SANITIZE=1`` builds it with AddressSanitizer and UndefinedBehaviorSanitizer.
"""

import glob
import os
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuild(build_ext):
    """Adds the FFI headers' path; a failed build warns instead of failing install."""

    def build_extensions(self):
        try:
            import jax.ffi

            include = jax.ffi.include_dir()
        except Exception as err:  # no jax in the build environment
            print(f"jaxcsr: native CPU kernels not built (no XLA FFI headers: {err})")
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)
        compile_one = self.compiler.compile

        def compile_all(sources, **kwargs):  # one compiler process per source file
            with ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:
                parts = list(pool.map(lambda source: compile_one([source], **kwargs), sources))
            return [obj for objects in parts for obj in objects]

        self.compiler.compile = compile_all
        try:
            super().build_extensions()
        except Exception as err:
            print(f"jaxcsr: native CPU kernels not built ({err}); products run on XLA")

    def get_ext_filename(self, ext_name):  # a plain library: no ABI tag in the name
        return os.path.join(*ext_name.split(".")) + ".so"


# no fused multiply-adds (results as written); no FP traps assumed (lets loops with
# selects, the softmax's exp, vectorise; nothing reads the FP exception flags)
flags = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
flags += ["-Wall", "-Wno-psabi"]  # psabi: 32-byte vectors in always-inlined helpers
link = []
if os.environ.get("JAXCSR_SANITIZE"):
    flags = ["-std=c++17", "-O0", "-g", "-fno-omit-frame-pointer"]
    flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
    link = ["-fsanitize=address,undefined"]

setup(
    ext_modules=[
        Extension(
            "jaxcsr.kernels._cpu_kernels",
            sources=sorted(glob.glob("jaxcsr/kernels/csrc/*.cc")),
            depends=sorted(glob.glob("jaxcsr/kernels/csrc/*.h")),
            language="c++",
            extra_compile_args=flags,
            extra_link_args=link,
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuild},
)
