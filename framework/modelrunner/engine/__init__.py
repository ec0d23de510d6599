"""The engine: sequences, the continuous-batching scheduler, and the step loop behind ``LLM``."""

from ..sampling.params import SamplingParams
from .input_processor import InputProcessor
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from .sequence import Request, Sequence, SequenceStatus
from .stop_checker import StopChecker

__all__ = [
    "LLMEngine",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "Scheduler",
    "SchedulerOutput",
    "ScheduledSequence",
    "Request",
    "Sequence",
    "SequenceStatus",
    "InputProcessor",
    "StopChecker",
]
