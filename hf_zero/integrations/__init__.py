"""Integrations with Hugging Face Accelerate and Transformers (they depend on the engine, never the reverse)."""
