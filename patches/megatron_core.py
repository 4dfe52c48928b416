"""Entry point for a checkout: the Megatron-core integration is ``moe_fp4.integrations.megatron_core``
(installed with the package); this module re-exports it."""

from moe_fp4.integrations.megatron_core import *  # noqa: F403
from moe_fp4.integrations.megatron_core import __all__, __getattr__  # noqa: F401
