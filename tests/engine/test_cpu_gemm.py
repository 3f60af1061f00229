"""CPU GEMMs through oneDNN (``Linear.pack_for_cpu`` / ``LlamaForCausalLM.pack_cpu_weights``): which weights are
packed, that the packed forward computes what ``F.linear`` does, and that a oneDNN linear failing its probe is not
used; and the MLP's row blocks of a long CPU forward. (Logits against transformers through the packed weights:
tests/engine/test_models.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from common.engine.model import layers
from common.engine.model.layers import Linear
from common.engine.model.loader import load_model
from tests.model_fixtures import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hidden states through every decoder layer's projections, then the LM head (no attention: the GEMMs only)."""
    with torch.inference_mode():
        for layer in model.model.layers:
            qkv = layer.self_attn.qkv_proj(x)
            x = x + layer.self_attn.o_proj(qkv[:, : x.shape[1]])
            x = x + layer.mlp(x)
        return model.compute_logits(x)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's tiny model ties its LM head to the embedding
def test_every_gemm_weight_is_packed_and_computes_what_f_linear_does(arch: str) -> None:
    plain = load_model(make_tiny_model(arch))[0]
    packed = load_model(make_tiny_model(arch))[0]
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    tied = plain.lm_head is None
    assert packed.pack_cpu_weights() == len(linears) + tied
    assert all(m.packed and m.weight.is_mkldnn for m in linears)
    assert (packed.tied_head_packed is not None) == tied
    if tied:  # the lookup keeps its weight
        assert torch.equal(packed.model.embed_tokens.weight, plain.model.embed_tokens.weight)
    x = torch.randn(5, plain.config.hidden_size, generator=torch.Generator().manual_seed(0))
    want, got = _logits(plain, x), _logits(packed, x)
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert packed.pack_cpu_weights() == len(linears) + tied  # packing twice changes nothing
    assert torch.equal(_logits(packed, x), got)


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    layers.onednn_linear_ok.cache_clear()
    yield
    layers.onednn_linear_ok.cache_clear()


def test_a_onednn_linear_that_fails_its_probe_is_not_used(monkeypatch: pytest.MonkeyPatch, fresh_probe: None,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    model = load_model(make_tiny_model("llama"))[0]
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = _logits(model, x)
    real = layers.onednn_linear
    monkeypatch.setattr(layers, "onednn_linear", lambda x, packed, bias: real(x, packed, bias) * 1.001)
    assert model.pack_cpu_weights() == 0
    assert "off by" in caplog.text
    assert not any(m.packed or m.weight.is_mkldnn for m in model.modules() if isinstance(m, Linear))
    assert torch.equal(_logits(model, x), want)


def test_bf16_weights_are_packed_where_onednn_has_bf16_kernels_and_fp16_never() -> None:
    bf16 = load_model(make_tiny_model("llama"), dtype=torch.bfloat16)[0]
    x = torch.randn(3, bf16.config.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = _logits(bf16, x)
    packed = bf16.pack_cpu_weights()
    assert packed == (len([m for m in bf16.modules() if isinstance(m, Linear)])
                      if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 0)
    got = _logits(bf16, x)
    assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert load_model(make_tiny_model("llama"), dtype=torch.float16)[0].pack_cpu_weights() == 0


def test_a_long_cpu_forward_runs_the_mlp_in_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of 3 blocks (the last one short) give what one call over all rows gives."""
    mlp = load_model(make_tiny_model("llama"))[0].model.layers[0].mlp
    x = torch.randn(40, mlp.gate_up_proj.weight.shape[1], generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = mlp(x)
        calls = []
        inner = mlp._forward
        monkeypatch.setattr(mlp, "_forward", lambda rows: calls.append(rows.shape[0]) or inner(rows))
        monkeypatch.setattr(layers, "MLP_BLOCK_BYTES", 16 * 2 * mlp.intermediate * x.element_size())
        got = mlp(x)
    assert calls == [16, 16, 8]
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
