"""Embeddings: encoder checkpoints (BERT-style sentence encoders) turned into one vector per input text."""

from engine.embeddings.bert import QUANTS
from engine.embeddings.model import POOLINGS, EmbeddingModel, load_embedding_model

__all__ = ["POOLINGS", "QUANTS", "EmbeddingModel", "load_embedding_model"]
