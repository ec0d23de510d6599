"""The kernel's quantization method ``none`` (dense float weights), declared like any plugin's; the
other methods and the matmul kernels are the ``modelrunner-quantization`` distribution's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..quantization.base import NoQuantization


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``none`` quantization method."""
    registry.quantization_methods(NoQuantization)
