"""Input layers: Input (shapes given in the model) and Data (records from LMDB)."""
from ..layer import Layer, register


@register("Input")
class InputLayer(Layer):
    """Tops of fixed shapes that the caller fills (net-level `input:` is upgraded to this)."""

    exact_bottoms = 0
    min_tops = 1

    def layer_setup(self, bottom, top):
        shapes = self.param.input_param.shape
        if len(shapes) not in (1, len(top)):
            raise self.error(f"gives {len(shapes)} shapes for {len(top)} tops: give one shape, "
                             f"or one per top")
        for i, t in enumerate(top):
            t.reshape(tuple(shapes[0 if len(shapes) == 1 else i].dim))

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        pass
