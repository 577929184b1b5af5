"""The LM heads the benchmarks time and the GPU tests check, in one place.

``(D, V)`` of real models' heads, bf16. Tests import these (the benchmark
shapes are also correctness tests on the GPU), benchmarks time them.
"""

HEADS = {
    "S": (4096, 151936),            # Qwen3-8B
    "L": (8192, 128256),            # Llama-3-70B
    "qwen3-1.7b": (2048, 151936),
    "gpt-oss": (2880, 201088),
}
