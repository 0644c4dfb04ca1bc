"""vlora: serve many LoRA adapters on one model, fast."""

from vlora.builder import build_engine
from vlora.engine.admission import SLO
from vlora.llm import LLM, AdapterRequest
from vlora.sampling_params import GuidedSpec, SamplingParams

__all__ = ["LLM", "SamplingParams", "GuidedSpec", "AdapterRequest", "SLO", "build_engine"]
