"""The model code of the batched engine: one runner per language-model architecture
(``runner.py``, Gemma 3's in ``families/gemma3.py``), rotary tables (``rope.py``), fused
linears (``linear.py``), vision features and their cache (``vision.py``,
``vision_cache.py``), the activation profile (``profile.py``), and one small adapter per VLM
family (``families/``); ``architectures.py`` maps a checkpoint to them.
"""
