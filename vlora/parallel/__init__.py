"""Tensor parallelism inside one replica: ``partition`` (Megatron cuts of the decoder and its adapters) and
``group`` (worker processes, the per-iteration message, failure handling)."""
