"""exl3tool inside the serving process: the drop-in encoder the vLLM fork loads from VLLM_EXL3_ENCODER_SOURCE.

``quantize_api`` holds ``quantize_exl3`` (exllamav3's signature, exl3tool's encoder); ``encoder_source`` writes
the directory the fork loads it from. Nothing here is imported by ``import exl3tool`` and neither module pulls in
the command line (typer, rich) or touches CUDA at import.
"""
