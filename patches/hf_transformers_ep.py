"""Entry point for a checkout: the EPImplementation classes are ``moe_fp4.integrations.hf_transformers_ep``
(installed with the package); this module re-exports them."""

from moe_fp4.integrations.hf_transformers_ep import *  # noqa: F403
from moe_fp4.integrations.hf_transformers_ep import __all__  # noqa: F401
