"""Builds the plugin's C++ kernels when it installs (``pip install --no-build-isolation``, after
modelrunner): one library per instruction-set variant, next to the package's modules. Without
modelrunner or torch where pip builds, the plugin installs without them and runs its pure-torch path."""

from setuptools import setup

try:
    from modelrunner.native_build import NativeLibrary, setup_kwargs
except ImportError as e:  # an isolated build environment: install without the kernels, saying so
    import warnings

    warnings.warn(f"modelrunner_quant_cpu: C++ kernels not built ({e}); install with --no-build-isolation",
                  stacklevel=1)
    setup()
else:
    # VNNI has int8 kernels of its own; AVX-512 and AVX2 each have theirs. The ggml-block kernels
    # differ from AVX-512 down only, but are built for every variant the other library has, so that
    # MODELRUNNER_NATIVE_VARIANT picks both the same way.
    variants = ("avx512_vnni", "avx512", "avx2", "generic")
    setup(**setup_kwargs([
        NativeLibrary("modelrunner_quant_cpu", "modelrunner_quant_cpu/quant_matmul.cpp", "quant_matmul", variants),
        NativeLibrary("modelrunner_quant_cpu", "modelrunner_quant_cpu/ggml_matmul.cpp", "ggml_matmul", variants),
    ]))
