"""What tests and the tiny-llama spec need and the product never imports: the tiny random
Llama pair (tiny.py) and the Markov pair whose distributions are known exactly (markov_pair.py,
the sampling tests' and lab/sampling_level.py's). An import-linter contract keeps every product package off it."""
