"""Adapters that plug cpattn into model libraries. Each lives in its own module and imports its library
only when used, so ``import cpattn`` never imports them (``cpattn.integrations.hf``: Hugging Face
transformers)."""
