"""qwen38-gateway: the OpenAI-compatible front door of a Qwen3.8-27B service on 1Cat-vLLM."""

__version__ = "0.1.0"
