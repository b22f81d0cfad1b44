"""The CPU equivalence checks, run on a CUDA device (``python -m pytest -m cuda``): tier
slices and Mix'n'Match, packed against padded, every attention kernel (torch's own flash SDPA
backend and flash-attn included), bf16 and fp16 training steps, and --compile.

Each test calls the check its CPU twin calls, on ``DEVICE``, with tolerances for GPU
arithmetic. Where torch sees no CUDA device every test is skipped, with the reason
(tests/conftest.py). ``MATFORMER_TEST_DEVICE=cpu`` runs the same bodies on the CPU, to check
them without a GPU; the few that mean something on CUDA only skip there, saying why.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.models import tiny_config
from test_attention import (
    KERNELS,
    assert_kernel_matches_reference,
    assert_model_logits_match_reference,
)
from test_batch import LAYOUTS, assert_documents_get_their_solo_logits
from test_batching_pack import assert_packed_rows_give_the_padded_gradient
from test_hardware import NO_CPU_COMPILER, assert_compiled_gives_eager_logits, assert_trains_in
from test_matformer import (
    MIXES,
    TIERS,
    assert_each_layer_runs_its_own_width,
    assert_ffn_tail_gets_zero_gradient,
    assert_tier_equals_its_slice,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from matformer.modeling import AutoregressiveModel, BERTModel
from matformer.modeling.devices import LossScale, Precision
from matformer.modeling.matformer import tier_label

pytestmark = pytest.mark.cuda
DEVICE = torch.device(os.environ.get("MATFORMER_TEST_DEVICE", "cuda"))
FP32 = dict(atol=1e-4, rtol=1e-4)  # fp32 without TF32: kernels differ in summation order only
BF16 = dict(atol=3e-2, rtol=3e-2)  # bf16/fp16 attention against the fp32 reference
LOGITS_BF16 = dict(atol=1e-2, rtol=1e-2)  # tiny models' logits are ~0.1; a leak moves them ~0.2
# "flash" is flash-attn where installed, else the registry's fallback (sdpa), as users get it.
NAMES = [name for name in KERNELS if name != "torch"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])


@pytest.fixture(autouse=True)
def _no_tf32(monkeypatch):
    """fp32 comparisons need fp32 products: TF32 (which a user or torch build may turn on)
    keeps 10 bits of mantissa."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("tier", [0, *TIERS, *MIXES], ids=tier_label)
def test_a_tier_gives_the_logits_of_the_model_built_from_its_slice(tier, activation):
    """Mix'n'Match lists (MIXES) included: each layer sliced at its own tier."""
    config = tiny_config(default_layer={"ffn_activation": activation})
    universal = AutoregressiveModel(config).to(DEVICE).eval()
    ids = torch.randint(0, 90, (2, 12)).to(DEVICE)
    assert_tier_equals_its_slice(universal, ids, tier, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
@pytest.mark.parametrize("tier", TIERS)
def test_the_ffn_tail_gets_exactly_zero_gradient(tier, activation):
    config = tiny_config(default_layer={"ffn_activation": activation})
    model = AutoregressiveModel(config).to(DEVICE)
    assert_ffn_tail_gets_zero_gradient(model, torch.randint(0, 90, (2, 12)).to(DEVICE), tier)


def test_mix_n_match_runs_each_layer_at_its_own_width():
    model = AutoregressiveModel(tiny_config(num_hidden_layers=3)).to(DEVICE).eval()
    assert_each_layer_runs_its_own_width(model, torch.randint(0, 90, (1, 8)).to(DEVICE))


@pytest.mark.parametrize("model_cls", [AutoregressiveModel, BERTModel])
def test_packed_rows_give_the_padded_gradient(model_cls):
    config = tiny_config(is_causal=model_cls is AutoregressiveModel)
    assert_packed_rows_give_the_padded_gradient(model_cls(config).to(DEVICE), **FP32)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("positional", ["rope", "alibi"])
@pytest.mark.parametrize("layout", LAYOUTS)
@CAUSAL
@pytest.mark.parametrize("precision", DTYPES)
def test_every_document_gets_its_solo_logits_padded_or_packed(kernel, positional, layout,
                                                              causal, precision):
    """In bf16, flash-attn (where installed) runs its varlen kernel on the packed rows."""
    tolerance = FP32 if precision == "fp32" else LOGITS_BF16
    assert_documents_get_their_solo_logits(kernel, positional, layout, causal, device=DEVICE,
                                           precision=Precision(precision, DEVICE), **tolerance)


@pytest.mark.parametrize("name", NAMES)
@CAUSAL
@pytest.mark.parametrize("pad", ["none", "left", "right", "packed"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_matches_the_reference(name, causal, pad, kv_heads, alibi, dtype):
    """Outputs and input gradients; flash-attn takes only the bf16 inputs (fp32 goes to
    sdpa), ALiBi's bias goes to sdpa too."""
    tolerance = FP32 if dtype == "fp32" else BF16
    assert_kernel_matches_reference(name, causal, pad, kv_heads, alibi, device=DEVICE,
                                    dtype=DTYPES[dtype], **tolerance)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("model_cls", [AutoregressiveModel, BERTModel])
@pytest.mark.parametrize("precision", DTYPES)
def test_every_kernel_gives_the_reference_logits(name, model_cls, precision):
    tolerance = FP32 if precision == "fp32" else LOGITS_BF16
    assert_model_logits_match_reference(name, model_cls, device=DEVICE,
                                        precision=Precision(precision, DEVICE), **tolerance)


@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_torch_flash_sdpa_backend_matches_the_reference(causal, kv_heads, dtype):
    """sdpa forced onto torch's flash backend: it raises rather than fall back where flash
    cannot run. Flash takes no mask, so only unpadded rows."""
    if DEVICE.type != "cuda":
        pytest.skip(f"torch's flash SDPA backend runs on CUDA only, not {DEVICE.type}")
    if not torch.backends.cuda.is_flash_attention_available():
        pytest.skip(f"torch {torch.__version__} was built without flash attention")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert_kernel_matches_reference("sdpa", causal, "none", kv_heads, alibi=False,
                                        device=DEVICE, dtype=dtype, **BF16)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_step_trains_with_falling_loss_and_float32_weights(precision):
    loss_scale = LossScale() if precision == "fp16" else None
    assert_trains_in(Precision(precision, DEVICE, loss_scale))


def test_the_compiled_model_gives_the_eager_logits():
    if DEVICE.type == "cpu" and NO_CPU_COMPILER:
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    assert_compiled_gives_eager_logits(DEVICE)
