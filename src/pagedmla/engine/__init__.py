"""The offline engine: sequences, paged blocks, scheduling, sampling, the LLM front."""

from pagedmla.engine.args import EngineArgs
from pagedmla.engine.llm import LLM
from pagedmla.engine.outputs import CompletionOutput, RequestOutput
from pagedmla.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "RequestOutput", "SamplingParams"]
