"""trtspec: ship speculative decoding safely (build, serve, verify, bench)."""

__version__ = "0.1.0"
