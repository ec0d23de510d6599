"""Kept for imports written before the ``modelrunner.sampling`` package: ``SamplingParams`` lives there."""

from ..sampling.params import SamplingParams

__all__ = ["SamplingParams"]
