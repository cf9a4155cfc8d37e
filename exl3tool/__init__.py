"""exl3tool: encode dense layers into EXL3 trellis weights ahead of time, into the serving stack's cache."""

__all__ = ["__version__"]

__version__ = "0.1.0"
