"""A stage's layers as the engine sees them: a table of blocks, block ``j`` one layer's attention
or MLP half in layer order (``schedule/megatron/blocks.py`` draws the picture). The lookups read
the table directly: each is called several times per block. What a block computes (``ln``,
``main``, ``bda``, its TP group, the yield points) is the subclass's: Megatron's layers in the
adapter, a stand-in in the engine's unit tests."""


class BlockTable:
    """``table``: (layer, kind, position of the layer in the stage) per block, in forward order
    (:meth:`table_of`); ``layers``: the stage's layers."""

    layers = ()
    table = ()

    @staticmethod
    def table_of(layers, kinds_of):
        """The table of ``layers``, ``kinds_of(layer)`` giving each layer's block kinds in order."""
        return [(layer, kind, i) for i, layer in enumerate(layers) for kind in kinds_of(layer)]

    @property
    def num_blocks(self):
        return len(self.table)

    def layer(self, j):
        return self.table[j][0]

    def kind(self, j):
        """``"attention"`` or ``"mlp"``."""
        return self.table[j][1]

    def attention(self, j):
        return self.table[j][1] == "attention"

    def layer_index(self, j):
        """Block j's layer's position in the stage."""
        return self.table[j][2]

    def first_block(self, i):
        """The first block of the stage's layer ``i`` (``num_blocks`` for ``i = len(layers)``)."""
        return next((j for j, (_, _, k) in enumerate(self.table) if k >= i), len(self.table))

    def layer_blocks(self, i):
        """The blocks of the stage's layer ``i``, in forward order."""
        return [j for j, (_, _, k) in enumerate(self.table) if k == i]

    def starts_layer(self, j):
        """Block j is its layer's first (its input is the layer's)."""
        return j == 0 or self.table[j - 1][2] != self.table[j][2]

    def global_layer(self, j):
        return self.layer(j).layer_number - 1
