"""The optional C++ part of kiln: the CPU kernels of the GGUF weight formats (models/kernels/cpu_quant.cc), an XLA FFI
handler built against jaxlib's headers (`jax.ffi.include_dir()`). Everything else is in pyproject.toml. Without a C++
compiler the build skips it and kiln computes those matmuls with XLA ops (kiln.models.kernels.cpu_quant logs it)."""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_include() -> list[str]:
    """jaxlib's headers (xla/ffi/api/ffi.h): jax.ffi.include_dir(), or jaxlib's folder when only jaxlib is installed
    (pyproject's build requirements)."""
    try:
        import jax.ffi

        return [jax.ffi.include_dir()]
    except Exception:
        pass
    try:
        import jaxlib

        return [os.path.join(os.path.dirname(os.path.abspath(jaxlib.__file__)), "include")]
    except Exception:  # no jaxlib in this build environment: the build fails over to XLA ops
        return []


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing when the extension cannot be compiled."""

    def run(self):
        try:
            super().run()
        except Exception as e:
            print(f"warning: kiln's CPU kernels were not built ({e}); GGUF-format matmuls will run as XLA ops")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:
            print(f"warning: kiln's CPU kernels were not built ({e}); GGUF-format matmuls will run as XLA ops")


setup(
    ext_modules=[
        Extension(
            "kiln.models.kernels._cpu_quant",
            sources=["models/kernels/cpu_quant.cc"],
            depends=["models/kernels/cpu_quant_simd.inc"],
            include_dirs=ffi_include(),
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-Wno-attributes", "-Wno-return-type"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
