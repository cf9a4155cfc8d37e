"""What a command does with a plan: ``warm`` (encode the misses), ``check`` (explain each miss), ``verify`` (the
trellis GEMM against FP32 references), ``exact`` (a fresh encode compared with an entry) and ``against``
(``cache import --against``). Each module is imported where it is used: this package imports none of them.
"""
