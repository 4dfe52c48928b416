"""Entry point for a checkout: the transformers integration is ``moe_fp4.integrations.hf_transformers``
(installed with the package); this module re-exports it."""

from moe_fp4.integrations.hf_transformers import *  # noqa: F403
from moe_fp4.integrations.hf_transformers import __all__, __getattr__  # noqa: F401
