"""Embeddings: pooling methods (a plugin kind), what a pooling request asks for, and what it returns.

``LLM.embed(prompts)`` / ``LLM.encode(prompts, PoolingParams(...))`` and the server's
``/v1/embeddings`` run prompts through the model without generating; a :class:`PoolingMethod`
(``last``, ``mean``, ``cls`` built in, others from plugins) turns each prompt's final hidden states
into one vector, truncated to ``dimensions`` and L2-normalised as the request asks.
"""

from .checkpoint import CheckpointPooling, checkpoint_pooling
from .method import CLSPool, LastPool, MeanPool, PoolingContext, PoolingMethod, READS, finish_embedding, rows_read
from .outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput
from .params import PoolingParams, check_dimensions, matryoshka_dimensions

__all__ = ["CLSPool", "CheckpointPooling", "EmbeddingOutput", "EmbeddingRequestOutput", "LastPool", "MeanPool",
           "PoolingContext", "PoolingMethod", "PoolingOutput", "PoolingParams", "PoolingRequestOutput", "READS",
           "check_dimensions", "checkpoint_pooling", "finish_embedding", "matryoshka_dimensions", "rows_read"]
