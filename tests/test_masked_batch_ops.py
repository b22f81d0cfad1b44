"""A MaskedBatch standing in for one example: torch ops, the Matchbox-style helpers and
``@batch`` give every example of a batch the result it gets alone (batched == looped), and
what they cannot do is refused with a named error.

Padding is NaN (or an out-of-range id) wherever that is possible, so any padding that reaches
a real result, or a gradient, shows up. The seed's own examples (Matchbox's README RNN, its
control-flow and RNN tests, its transformer's LayerNorm, Attention and MultiHead) run as
written, with three spellings of ours: ``MaskedBatch.from_list`` for ``fromlist`` (it accepts
the seed's (1, ...) examples too); helpers called as functions, ``split_dim(x, -1, n)`` for
``x.split_dim(-1, n)``, since the same code must run on plain tensors and we do not patch
methods onto ``torch.Tensor``; and ``softmax`` given the ``dim`` that torch requires.
"""

from __future__ import annotations

import math
from random import Random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from matformer.modeling import (
    BatchControlFlowError,
    BatchDimError,
    BatchShapeError,
    DynamicDimError,
    MaskedBatch,
    UnsupportedBatchOp,
    assert_batch_equivalent,
    batch_ones,
    batch_zeros,
    causal_mask,
    join_dims,
    split_dim,
)
from matformer.modeling.batch_decorator import batch

LENGTHS = [3, 1, 4, 2]
C = 4
NAN = float("nan")


def sequences(features: int = C, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, features, generator=generator) for n in LENGTHS]


def nan_padded(examples):
    return MaskedBatch.from_list(examples, pad_value=NAN)


def check(fn, examples=None, make_batch=nan_padded, **tolerance):
    return assert_batch_equivalent(fn, sequences() if examples is None else examples,
                                   make_batch, **tolerance)


BIAS = torch.randn(C)
WEIGHT = torch.randn(C, 2)

ELEMENTWISE = {
    "relu": F.relu, "gelu": F.gelu, "silu": F.silu, "tanh": torch.tanh,
    "sigmoid": torch.sigmoid, "exp": torch.exp, "neg": lambda x: -x, "abs": abs,
    "method chain": lambda x: x.tanh().float().clamp(-0.5, 0.5),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1), "nn.GELU": nn.GELU(),
    "dropout in eval": nn.Dropout(0.5).eval(),
    "batch + batch": lambda x: x + x * 2, "batch - tensor": lambda x: x - BIAS,
    "tensor * batch": lambda x: BIAS * x, "number / batch": lambda x: 2 / (x.abs() + 1),
    "number - batch": lambda x: 1 - x, "power": lambda x: x ** 2 + 2 ** x,
    "comparisons": lambda x: (x > 0) & (x <= 1) | (x == 0),
    "where": lambda x: torch.where(x > 0, x, torch.zeros(C)),
    "max(a, b)": lambda x: torch.max(x, BIAS), "ones_like": torch.ones_like,
    "static broadcast": lambda x: x - x.mean(-1, keepdim=True),
}


@pytest.mark.parametrize("fn", ELEMENTWISE.values(), ids=ELEMENTWISE)
def test_elementwise_ops_equal_the_loop(fn):
    check(fn)


def test_masks_of_two_batches_combine_with_and():
    a = MaskedBatch.from_list([torch.ones(3), torch.ones(1)])
    b = MaskedBatch.from_list([torch.ones(2), torch.ones(3)])
    total = a + b
    assert total.mask.tolist() == (a.mask & b.mask).tolist()
    assert total.dims == (True,)
    assert [e.tolist() for e in total.examples()] == [[2.0, 2.0], [2.0]]


def test_a_plain_tensor_may_not_push_the_batch_dimension_away():
    with pytest.raises(BatchShapeError, match="more dimensions than the batch"):
        nan_padded(sequences()) + torch.ones(2, 1, 1, C)


REDUCTIONS = {
    "sum static": lambda x: x.sum(-1), "sum dynamic": lambda x: x.sum(1),
    "mean dynamic keepdim": lambda x: x.mean(1, keepdim=True),
    "mean static": lambda x: torch.mean(x, 2), "amax dynamic": lambda x: x.amax(1),
    "max with indices": lambda x: torch.max(x, 1), "min values": lambda x: x.min(1).values,
    "logsumexp": lambda x: torch.logsumexp(x, 1), "prod": lambda x: x.prod(1),
    "any": lambda x: (x > 0).any(1), "all": lambda x: (x > 0).all(1),
    "argmax dynamic": lambda x: x.argmax(1), "std static": lambda x: x.std(-1, keepdim=True),
    "var static": lambda x: x.var(2), "median static": lambda x: x.median(-1).values,
    "several dims": lambda x: x.sum((1, 2)), "per example sum": lambda x: x.sum(),
    "per example mean": lambda x: x.mean(), "per example max": lambda x: x.max(),
}


@pytest.mark.parametrize("fn", REDUCTIONS.values(), ids=REDUCTIONS)
def test_reductions_equal_the_loop(fn):
    check(fn)


@pytest.mark.parametrize("fn, error, message", [
    (lambda x: x.sum(0), BatchDimError,
     r"torch.Tensor.sum over dimension 0 would mix examples: dimension 0 of a MaskedBatch is "
     r"the batch dimension"),
    (lambda x: x.std(1), DynamicDimError,
     r"torch.Tensor.std over dynamic dimension 1 would count each example's padding"),
    (lambda x: torch.median(x, 1), DynamicDimError, r"torch.median over dynamic dimension 1"),
    (lambda x: x.argmax(), DynamicDimError, r"flat indices, which padding shifts; pass dim"),
], ids=["batch dim", "std over dynamic", "median over dynamic", "argmax without dim"])
def test_reductions_refuse_what_would_mix_examples_or_count_padding(fn, error, message):
    with pytest.raises(error, match=message):
        fn(nan_padded(sequences()))


SOFTMAXES = {
    "torch.softmax dynamic": lambda x: torch.softmax(x, 1),
    "F.softmax static": lambda x: F.softmax(x, dim=-1),
    "method dynamic": lambda x: x.softmax(1),
    "log_softmax dynamic": lambda x: F.log_softmax(x, 1),
}


@pytest.mark.parametrize("fn", SOFTMAXES.values(), ids=SOFTMAXES)
def test_softmax_ignores_padding(fn):
    check(fn)


def test_softmax_over_a_dynamic_dim_gives_padding_no_probability():
    probs = torch.softmax(nan_padded(sequences()), 1)
    assert probs.data[~probs.mask.expand_as(probs.data)].eq(0).all()
    torch.testing.assert_close(probs.data.sum(1), torch.ones(len(LENGTHS), C))


def test_softmax_refuses_the_batch_dim_and_a_missing_dim():
    x = nan_padded(sequences())
    with pytest.raises(BatchDimError, match=r"torch\.softmax over dimension 0"):
        torch.softmax(x, 0)
    with pytest.raises(UnsupportedBatchOp, match="needs an explicit dim"):
        F.softmax(x)


LINEAR = nn.Linear(C, 3)
PRODUCTS = {
    "batch @ matrix": lambda x: x @ WEIGHT, "batch @ vector": lambda x: x @ BIAS,
    "torch.matmul": lambda x: torch.matmul(x, WEIGHT), "F.linear": lambda x: F.linear(x, WEIGHT.T),
    "nn.Linear": LINEAR, "scores over padding": lambda x: x @ x.transpose(1, 2),
    "attention": lambda x: torch.softmax(x @ x.transpose(1, 2) / 2, -1) @ x,
}


@pytest.mark.parametrize("fn", PRODUCTS.values(), ids=PRODUCTS)
def test_matrix_products_contract_only_real_positions(fn):
    check(fn)


def test_matmul_and_linear_refuse_the_batch_dim_and_dynamic_contractions():
    vectors = MaskedBatch.from_list([torch.randn(C) for _ in LENGTHS], dims=(False,))
    with pytest.raises(BatchShapeError, match="treat its batch dimension as a matrix"):
        torch.randn(2, len(LENGTHS)) @ vectors
    ragged = MaskedBatch.from_list([torch.randn(n) for n in LENGTHS])
    with pytest.raises(DynamicDimError, match=r"F\.linear mixes the last 1 dimension"):
        F.linear(ragged, torch.randn(2, max(LENGTHS)))


def test_layer_norm_embedding_and_dropout_equal_the_loop():
    check(nn.Sequential(nn.LayerNorm(C), nn.Dropout(0.3).eval(), nn.GELU()))
    ids = [torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(n))
           for n in LENGTHS]
    check(nn.Embedding(10, 3), ids, lambda xs: MaskedBatch.from_list(xs, pad_value=-1))


def test_layer_norm_refuses_a_dynamic_dim():
    x = nan_padded(sequences())
    with pytest.raises(DynamicDimError,
                       match=r"torch\.nn\.functional\.layer_norm mixes the last 2"):
        F.layer_norm(x, (max(LENGTHS), C))


class RNN(nn.Module):
    """Matchbox's README example (plus the super().__init__() that nn.Module needs)."""

    def __init__(self, size, cell=nn.RNNCell):
        super().__init__()
        self.cell = cell(size, size)

    def forward(self, x):
        h = x.new_zeros(x.size(0), x.size(-1))
        for xt in x.unbind(1):
            h = self.cell(xt, h)
        return h


@pytest.mark.parametrize("cell", [nn.RNNCell, nn.GRUCell])
def test_an_rnn_cell_over_a_masked_sequence_ends_at_each_examples_length(cell):
    check(RNN(C, cell))


def test_the_readme_rnn_runs_on_a_batch_built_as_the_readme_builds_it():
    randint = Random(1).randint
    b, t, c = 5, 4, 3
    model = RNN(c)
    x_unbatched = torch.rand(1, randint(1, t), c)
    examples = [torch.rand(1, randint(1, t), c) for i in range(b)]
    x_manual_batch = MaskedBatch.from_list(examples, (True, False))
    assert model(x_unbatched).shape == (1, c)
    h = model(x_manual_batch)
    for example, batched in zip(examples, h.examples(), strict=True):
        torch.testing.assert_close(batched, model(example)[0])


class LSTM(nn.Module):
    def __init__(self, size):
        super().__init__()
        self.cell = nn.LSTMCell(size, size)

    def forward(self, x):
        h = c = x.new_zeros(x.size(0), x.size(-1))
        for xt in x.unbind(1):
            h, c = self.cell(xt, (h, c))
        return h, c


def test_an_lstm_cell_carries_both_states():
    check(LSTM(C))


class AccumRNN(nn.Module):
    """Matchbox's AccumRNNClass: per-step outputs, stacked, end at each example's length."""

    def __init__(self, size):
        super().__init__()
        self.cell = nn.RNNCell(size, size)

    @batch
    def forward(self, x):
        h = x.new_zeros(x.size(0), x.size(-1))
        encoding = []
        for xt in x.unbind(1):
            h = self.cell(xt, h)
            encoding.append(h)
        return torch.stack(encoding, 1)


def test_stacked_per_step_outputs_under_batch_end_at_each_examples_length():
    out = check(AccumRNN(C))
    assert out.dims == (True, False)


class BackwardLSTM(nn.Module):
    """The backward half of Matchbox's BiLSTMClass, keeping its per-step outputs."""

    def __init__(self, size):
        super().__init__()
        self.cell = nn.LSTMCell(size, size)

    @batch
    def forward(self, x):
        h = c = x.new_zeros(x.size(0), x.size(-1))
        outputs = []
        for xt in reversed(x.unbind(1)):
            h, c = self.cell(xt, (h, c))
            outputs.append(h)
        return torch.stack(outputs[::-1], 1), c


def test_a_reversed_lstm_under_batch_starts_at_each_examples_own_last_step():
    check(BackwardLSTM(C))


class LayerNorm(nn.Module):
    """From Matchbox's transformer example, as written."""

    def __init__(self, d_model, eps=1e-6):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        std = x.std(-1, keepdim=True)
        return self.gamma * (x - mean) / (std + self.eps) + self.beta


class Attention(nn.Module):
    def __init__(self, d_key, drop_ratio, causal=False):
        super().__init__()
        self.scale = math.sqrt(d_key)
        self.dropout = nn.Dropout(drop_ratio)
        self.causal = causal

    def forward(self, query, key, value):
        dot_products = query @ key.transpose(1, 2)
        if self.causal and query.dim() == 3:
            dot_products = causal_mask(dot_products, in_dim=2, out_dim=1)
        return self.dropout((dot_products / self.scale).softmax(-1)) @ value


class MultiHead(nn.Module):
    def __init__(self, attention, d_key, d_value, n_heads):
        super().__init__()
        self.attention = attention
        self.wq = nn.Linear(d_key, d_key)
        self.wk = nn.Linear(d_key, d_key)
        self.wv = nn.Linear(d_value, d_value)
        self.wo = nn.Linear(d_value, d_key)
        self.n_heads = n_heads

    def forward(self, query, key, value):
        query, key, value = self.wq(query), self.wk(key), self.wv(value)
        # B x T x D -> B x T x (D/N) x N -> (B*N) x T x (D/N)
        query, key, value = (join_dims(split_dim(x, -1, self.n_heads), 0, -1)
                             for x in (query, key, value))
        outputs = self.attention(query, key, value)
        # (B*N) x T x (D/N) -> B x N x T x (D/N) -> B x T x D
        outputs = join_dims(split_dim(outputs, 0, self.n_heads), -1, 1)
        return self.wo(outputs)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_seed_transformer_parts_equal_the_loop(causal):
    check(LayerNorm(C))
    check(lambda x: Attention(C, 0, causal)(x, x, x))
    heads = MultiHead(Attention(C, 0, causal), C, C, 2).eval()
    check(lambda x: heads(x, x, x))


GRADIENT_MODELS = {
    "linear, norm": lambda: nn.Sequential(nn.Linear(C, C), LayerNorm(C), nn.Tanh(),
                                          nn.Linear(C, 2)),
    "rnn": lambda: RNN(C),
    "accumulating rnn": lambda: AccumRNN(C),
    "causal multi-head": lambda: MultiHead(Attention(C, 0, True), C, C, 2),
}


@pytest.mark.parametrize("build", GRADIENT_MODELS.values(), ids=GRADIENT_MODELS)
def test_nan_padding_reaches_no_gradient(build):
    model, examples = build(), sequences()

    def run(x):
        return model(x, x, x) if isinstance(model, MultiHead) else model(x)

    sum(out.sum() for out in run(nan_padded(examples)).examples()).backward()
    batched = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sum(run(x[None]).sum() for x in examples).backward()
    for got, parameter in zip(batched, model.parameters(), strict=True):
        torch.testing.assert_close(got, parameter.grad, atol=1e-5, rtol=1e-4)


def test_batch_ones_and_zeros_have_one_row_per_example():
    x = nan_padded(sequences())
    assert batch_ones(x, 2).shape == (len(LENGTHS), 2)
    assert batch_zeros(sequences()[0][None], 2).tolist() == [[0.0, 0.0]]
    check(lambda x: x * batch_ones(x) + batch_zeros(x))


SHAPES = {
    "split_dim": lambda x: split_dim(x, -1, 2),
    "split then join": lambda x: join_dims(split_dim(x, -1, 2), 2, 3),
    "through the batch dim": lambda x: join_dims(split_dim(
        join_dims(split_dim(x, -1, 2), 0, -1) * 3, 0, 2), -1, 1),
    "transpose": lambda x: x.transpose(1, 2), "permute": lambda x: x.permute(0, 2, 1),
    "unsqueeze, squeeze": lambda x: x.unsqueeze(-1).squeeze(3),
    "cat static": lambda x: torch.cat([x, x * 2], -1),
    "stack, unbind": lambda x: torch.stack(x.unbind(2), 2),
    "causal scores": lambda x: causal_mask(x @ x.transpose(1, 2), 2, 1).softmax(-1) @ x,
}


@pytest.mark.parametrize("fn", SHAPES.values(), ids=SHAPES)
def test_shape_ops_and_helpers_equal_the_loop(fn):
    check(fn)


def test_causal_mask_hides_later_positions():
    scores = torch.zeros(1, 3, 3)
    hidden = causal_mask(scores, in_dim=2, out_dim=1)
    assert (hidden[0] == torch.finfo(torch.float32).min).tolist() == [
        [False, True, True], [False, False, True], [False, False, False]]
    x = nan_padded(sequences())
    masked = causal_mask(x @ x.transpose(1, 2), in_dim=2, out_dim=1)  # (B, queries, keys)
    assert masked.dims == (True, True)
    assert masked.mask[2].tolist() == torch.ones(4, 4).tril().bool().tolist()  # length 4


@pytest.mark.parametrize("fn, error, message", [
    (lambda x: split_dim(x, 1, 1), DynamicDimError, "split_dim: dimension 1 is dynamic"),
    (lambda x: split_dim(x, -1, 3), BatchShapeError, "has size 4, which 3 does not divide"),
    (lambda x: join_dims(x, 1, 2), DynamicDimError, "must both be static"),
    (lambda x: torch.cat([x, x], 1), DynamicDimError, "torch.cat along dynamic dimension 1"),
    (lambda x: x.transpose(0, 1), BatchDimError, "over dimension 0 would mix examples"),
    (lambda x: x.unsqueeze(0), BatchDimError, r"unsqueeze\(0\) would put a new dimension"),
    (lambda x: x.permute(1, 0, 2), BatchDimError, "moves the batch dimension"),
], ids=["split dynamic", "split indivisible", "join dynamic", "cat dynamic", "transpose batch",
        "unsqueeze batch", "permute batch"])
def test_shape_ops_refuse_with_the_reason(fn, error, message):
    with pytest.raises(error, match=message):
        fn(nan_padded(sequences()))


def test_an_unsupported_op_is_refused_by_name():
    x = nan_padded(sequences())
    with pytest.raises(UnsupportedBatchOp, match=r"^torch.cumsum is not implemented for "
                                                 r"MaskedBatch"):
        torch.cumsum(x, 1)
    with pytest.raises(UnsupportedBatchOp, match=r"^torch.Tensor.cumsum is not implemented"):
        x.cumsum(1)
    with pytest.raises(UnsupportedBatchOp, match=r"^torch.Tensor.__getitem__ is not"):
        x[:, 0]
    with pytest.raises(DynamicDimError, match="dimension 1 of this MaskedBatch is dynamic"):
        x.shape  # noqa: B018
    assert (x.size(0), x.size(-1), x.maxsize(1)) == (len(LENGTHS), C, max(LENGTHS))


def test_from_list_accepts_examples_written_at_batch_size_one():
    seed_layout = MaskedBatch.from_list([torch.rand(1, 3, 2), torch.rand(1, 1, 2)], (True, False))
    assert seed_layout.data.shape == (2, 3, 2) and seed_layout.dims == (True, False)
    scalars = MaskedBatch.from_list([torch.rand(1) for _ in range(4)], ())
    assert scalars.data.shape == scalars.mask.shape == (4,) and scalars.dims == ()


def test_the_equivalence_check_refuses_a_result_that_is_padding_for_some_example():
    with pytest.raises(AssertionError, match="example 0: the batched result marks part"):
        check(lambda x: x.unbind(1)[-1])  # the last padded step: padding for short examples


# Per-example control flow: one value per example, each example on its own path.

def scalars(*values):
    return [torch.tensor(float(v)) for v in values]


@batch
def while_loop(x):
    while x > 0:
        x = x - 1
    return x


@batch
def if_else(x):
    if x > 0:
        x = x - 1
    else:
        pass
    return x


@batch
def if_noelse(x):
    if x > 0:
        x = x - 1
    return x


@batch
def count_down(x):
    steps = 0
    while x > 0:
        x = x - 1
        steps = steps + 1
    return x * 0 + steps


@batch
def collatz(x):
    steps = x * 0
    while x > 1 and steps < 20:
        if x % 2 == 0:
            x = x / 2
        elif not x > 5:
            x, steps = x + 1, steps + 0.5
        else:
            x = 3 * x + 1
        steps += 1
    return x + 100 * steps


@pytest.mark.parametrize("fn", [while_loop, if_else, if_noelse, count_down, collatz])
def test_batch_gives_each_example_its_own_branches_and_iterations(fn):
    check(fn, scalars(2.5, -1, 0.5, 7, 6, 1), MaskedBatch.from_list)


@batch
def flip_if_negative(x):
    if x.sum() < 0:
        x = -x
    return x


@batch
def branches(x):
    if x.mean() > 0:
        y: torch.Tensor = x * 2
    else:
        y = x - 1
    return y


@batch
def shrink(x, skip=False):
    if skip:  # a plain condition keeps Python's meaning, return included
        return x
    while x.abs().amax() > 1:
        x = x / 2
    return x


@pytest.mark.parametrize("fn", [flip_if_negative, branches, shrink])
def test_batch_conditions_on_per_example_reductions(fn):
    check(fn, [s * 4 for s in sequences()])


class Base(nn.Module):
    def scale(self, x):
        return x * 2


class Gate(Base):
    def __init__(self):
        super().__init__()
        self.__limit = 0.5

    @batch
    def forward(self, x, offset=1.0):
        if x.amax() > self.__limit:
            x = super().scale(x) + offset
        return x


def test_batch_keeps_methods_closures_and_defaults_working():
    shift = 3.0

    @batch
    def shifted(x):
        if x.mean() < 0:
            x = x + shift
        return x

    check(shifted)
    check(Gate())


def test_a_batch_has_no_single_truth_value():
    x = nan_padded(sequences())
    with pytest.raises(BatchControlFlowError, match="one truth value per example"):
        if x.sum() > 0:
            pass


def test_batch_refuses_control_flow_it_cannot_mask():
    @batch
    def wide_condition(x):
        if x > 0:
            x = x - 1
        return x

    @batch
    def early_return(x):
        if x.sum() > 0:
            return x
        return -x

    @batch
    def stepwise_break(x):
        for xt in x.unbind(1):
            if bool(xt.data.sum() > 100):
                break
        return x

    class Recorder(nn.Module):
        @batch
        def forward(self, x):
            if x.sum() > 0:
                self.last = x
            return x

    x = nan_padded(sequences())
    with pytest.raises(BatchControlFlowError, match="must be one value per example"):
        wide_condition(x)
    with pytest.raises(BatchControlFlowError, match="whose body holds return"):
        early_return(x)
    with pytest.raises(BatchControlFlowError, match="cannot step over a dynamic dimension"):
        stepwise_break(x)
    with pytest.raises(BatchControlFlowError, match=r"`self.last = x` writes to an attribute"):
        Recorder()(x)
    with pytest.raises(BatchControlFlowError, match=r"while \.\.\. else"):
        batch(while_else)
    with pytest.raises(BatchControlFlowError, match="applies to a `def` function"):
        batch(lambda x: x)


def while_else(x):
    while x > 0:
        x = x - 1
    else:
        x = x + 1
    return x
