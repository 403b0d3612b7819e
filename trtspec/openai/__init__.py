"""OpenAI-compatible API in front of a served trtspec deployment (`trtspec openai`)."""
