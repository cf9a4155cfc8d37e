"""The tiny family checkpoints moved into the library (``exl3tool.checkpoint.tiny``, behind ``exl3tool synth``);
this name stays so tests that import ``tiny_models`` keep working. New tests import the library module."""

from exl3tool.checkpoint.tiny import *  # noqa: F401,F403
from exl3tool.checkpoint.tiny import MLA, QWEN3_NEXT, QWEN35, GLM53, GLM4_MOE, _experts  # noqa: F401
