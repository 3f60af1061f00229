"""``zero_attention_output_``: the copy workload's model made from weights already built (``--load-format dummy``
has no file to rewrite), in place for plain weights (what CUDA graphs captured before read) and by replacement for
CPU weights packed into oneDNN's layout (whose ``zero_`` leaves some blocks of a packed matrix as they were)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from common.engine.model.layers import Linear
from common.engine.model.loader import load_model
from common.model_gen.copy_model import zero_attention_output_
from tests.model_fixtures import make_tiny_model


def _check(model: nn.Module, projections: list[Linear], packed: bool) -> None:
    if packed and not all(p.pack_for_cpu() for p in projections):
        pytest.skip("oneDNN's fp32 linear is not available on this CPU")
    x = torch.randn(3, projections[0].weight.shape[1], generator=torch.Generator().manual_seed(0))
    assert all(p(x).abs().max() > 0 for p in projections)
    weights = [p.weight for p in projections]

    assert zero_attention_output_(model) == len(projections)
    assert all(torch.equal(p(x), torch.zeros(3, p.weight.shape[0])) for p in projections)
    if not packed:  # the same tensors, zeroed where they live
        assert all(p.weight is w for p, w in zip(projections, weights, strict=True))


@pytest.mark.parametrize("packed", [False, True])
def test_every_attention_output_projection_of_the_model_writes_zeros(packed: bool) -> None:
    model, _ = load_model(make_tiny_model("llama"), load_format="dummy")
    _check(model, [layer.self_attn.o_proj for layer in model.model.layers], packed)


def test_a_packed_projection_of_an_odd_shape_with_a_bias_writes_zeros() -> None:
    block = nn.Module()
    block.self_attn = nn.Module()
    block.self_attn.o_proj = proj = Linear(16, 8, True, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        proj.weight.normal_(generator=torch.Generator().manual_seed(1))
        proj.bias.fill_(0.5)
    _check(block, [proj], packed=True)


def test_a_model_without_attention_output_projections_is_refused() -> None:
    with pytest.raises(ValueError, match="o_proj"):
        zero_attention_output_(nn.Sequential(nn.Linear(4, 4)))
