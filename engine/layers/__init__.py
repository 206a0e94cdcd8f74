"""Built-in layer types, one family per module; importing this package registers them all."""
from . import (activation, conv, data, dropout, inner_product, loss, normalization, pooling,  # noqa: F401
               python_layer, scale_bias, structure)
