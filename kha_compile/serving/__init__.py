"""Serving engines: run a saved KHA model in an engine built for serving (the vLLM plugin: :mod:`.vllm`)."""
