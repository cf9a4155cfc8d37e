"""exl3tool's version, on the ground floor: the cache's records and entries, bundles and the encoder source stamp
it, and the package root (on top) re-exports it as ``exl3tool.__version__``."""

__version__ = "0.1.0"
