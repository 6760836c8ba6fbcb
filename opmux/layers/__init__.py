"""Layers built on opmux ops: the rows of vLLM's CustomOp table, one module per family.

Every public name of a family module (its ``__all__``) is public here too.
"""

from opmux.layers import (
    activation,
    attention,
    conv,
    embedding,
    linear,
    logits,
    mamba,
    mamba2,
    moe,
    moe_methods,
    moe_router,
    norm,
    quant,
    rotary,
)
from opmux.layers.activation import *  # noqa: F403
from opmux.layers.attention import *  # noqa: F403
from opmux.layers.conv import *  # noqa: F403
from opmux.layers.embedding import *  # noqa: F403
from opmux.layers.linear import *  # noqa: F403
from opmux.layers.logits import *  # noqa: F403
from opmux.layers.mamba import *  # noqa: F403
from opmux.layers.mamba2 import *  # noqa: F403
from opmux.layers.moe import *  # noqa: F403
from opmux.layers.moe_methods import *  # noqa: F403
from opmux.layers.moe_router import *  # noqa: F403
from opmux.layers.norm import *  # noqa: F403
from opmux.layers.quant import *  # noqa: F403
from opmux.layers.rotary import *  # noqa: F403

__all__ = sorted({
    *activation.__all__, *attention.__all__, *conv.__all__, *embedding.__all__,
    *linear.__all__, *logits.__all__, *mamba.__all__, *mamba2.__all__, *moe.__all__,
    *moe_methods.__all__, *moe_router.__all__, *norm.__all__, *quant.__all__, *rotary.__all__,
})
