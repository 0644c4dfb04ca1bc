"""Tensor parallelism inside one replica: ``partition`` (Megatron cuts of the decoder and its adapters),
``group`` (worker processes, failure handling), ``messages`` (what rank 0 sends each iteration), ``worker``
(a worker's shard and loop), ``model`` (rank 0's model, mode switcher and decode graphs) and ``collectives``
(the process group and its all-reduce).

An LMM's vision tower runs on rank 0 only: its output, the image tokens' embeddings, goes to the workers in the
iteration's message like the token ids, and it is small next to what the language model computes from it (an
image's few hundred rows of hidden size), while a replicated tower would cost every worker its weights and
the same compute for the same result, and a split one an all-reduce per tower layer.
"""
