"""Torch reference engines: the decoder, the engine with its slot KV cache, and their build."""
