"""What tests and the tiny-llama spec need and the product never imports: the tiny random
Llama pair (tiny.py) and the Markov pair whose distributions are known exactly (markov_pair.py,
the sampling tests' and lab/sampling_level.py's); and what the product's tests share with the
lab, which they never import: a process tree's memory (process_memory.py), peer trainers' heads
in trtspec's layout (peer_heads.py), vLLM driven in its own environment (vllm_worker.py,
vllm_peer.py). An import-linter contract keeps every product package off it."""
