"""What tests and the tiny-llama spec need and the product never imports: the tiny random
Llama pair (tiny.py). An import-linter contract keeps every product package off it."""
