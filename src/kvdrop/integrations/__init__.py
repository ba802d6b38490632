"""kvdrop policies in other frameworks: :mod:`kvdrop.integrations.transformers` (Hugging Face
``transformers``, imported lazily)."""
