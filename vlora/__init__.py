"""vlora: serve many LoRA adapters on one model, fast."""

from vlora.engine.admission import SLO
from vlora.engine.llm import LLM, AdapterRequest
from vlora.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "AdapterRequest", "SLO"]
