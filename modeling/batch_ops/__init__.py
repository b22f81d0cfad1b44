"""What torch ops do to a MaskedBatch: the table behind ``MaskedBatch.__torch_function__``.

``table`` holds the registry and the dispatch; each other module registers one family of ops
and its docstring says what the family does at the mask: ``elementwise``, ``reductions``,
``layers`` (softmax, matmul, linear, norms, embedding, recurrent cells) and ``shapes``. An op
with no entry raises ``UnsupportedBatchOp`` naming it.
"""

from matformer.modeling.batch_ops import elementwise, layers, reductions, shapes  # noqa: F401
from matformer.modeling.batch_ops.table import OPS, dispatch, implements

__all__ = ["OPS", "dispatch", "implements"]
