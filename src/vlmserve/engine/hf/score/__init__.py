"""Relevance scores for query-document pairs: cross-encoder rerankers (``backend.py``), their
prompts (``prompts.py``) and score heads (``heads.py``)."""
