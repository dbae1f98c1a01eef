"""A model whose layers join earlier outputs at random: graphs the planners were not designed on."""

from torch import nn


class RandomDAG(nn.Module):
    """Linear layers whose inputs are any earlier outputs (DenseNet-like and ResNet-like joins)."""

    def __init__(self, width, edges):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in edges)
        self.edges = edges

    def forward(self, x):
        outputs = [x]
        for layer, sources in zip(self.layers, self.edges):
            joined = sum(outputs[s % len(outputs)] for s in sources)
            outputs.append(layer(joined).relu())
        return outputs[-1]
