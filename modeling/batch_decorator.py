"""``@batch``: write a function for one example, with ``if``, ``while`` and ``for`` on that
example's own values, and run it on a MaskedBatch with each example taking its own path.

The decorator reads the function's source, rewrites its control flow into calls to
``modeling.batch_flow`` (whose docstring gives the semantics) and compiles the result with the
original globals, closure cells, defaults and (for methods) class, so ``super()`` and private
names keep working. On plain tensors the rewritten function does what the original does: every
condition is then a plain value, and plain values keep Python's meaning.

What is rewritten, in the decorated function's own body (nested ``def``/``class``/``lambda``
keep plain Python):

- ``if``/``elif``/``else`` and ``while`` become blocks that track the active examples;
  ``and``/``or``/``not`` at the top of their tests become elementwise on batches;
- ``for`` lets each item (a step of ``x.unbind(1)``) decide which examples take the step;
- inside those blocks, assignments to names (``x = ...``, ``a, b = ...``, ``x += ...``,
  ``x: T = ...``) change only the active examples' rows, and each body restores what the
  examples that skipped it see.

Limits, each refused with ``BatchControlFlowError`` where it can be detected:

- ``return``, ``break``, ``continue`` and ``yield`` inside an ``if``/``while``/``for`` are
  allowed only while its test (or its steps) is the same for every example;
- ``while ... else``, ``for ... else`` and ``match`` inside a block are refused outright;
- writes to attributes and items (``self.h = ...``, ``a[i] = ...``) in a per-example block;
- not detected: a value that leaves a block other than through an assigned name (appending a
  value computed before the block) is not masked, and ``:=``, ``global`` and ``nonlocal`` names
  are not merged; ``torch.where``-style merging also means a branch runs on every row, so its
  gradient is NaN where a skipped row's computation is (e.g. ``sqrt`` of a negative);
- the function needs source in a file (not a lambda, not the interactive interpreter), and
  ``@batch`` must be the decorator nearest the ``def``;
- a ``@batch`` function called inside another's per-example block runs for all examples; the
  caller's assignment of its result is what masks it.
"""

from __future__ import annotations

import ast
import copy
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any, TypeVar

from matformer.modeling import batch_flow
from matformer.modeling.errors import BatchControlFlowError

Fn = TypeVar("Fn", bound=Callable[..., Any])

FLOW = "_batch_flow"  # the name the rewritten code reaches modeling.batch_flow by
OPERATORS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "truediv",
             ast.FloorDiv: "floordiv", ast.Mod: "mod", ast.Pow: "pow", ast.MatMult: "matmul",
             ast.BitAnd: "and_", ast.BitOr: "or_", ast.BitXor: "xor", ast.LShift: "lshift",
             ast.RShift: "rshift"}


def batch(fn: Fn) -> Fn:
    """Rewrite ``fn`` so per-example ``if``/``while``/``for`` run on a MaskedBatch; see the
    module docstring for the rules and limits."""
    if not isinstance(fn, types.FunctionType) or inspect.unwrap(fn) is not fn:
        raise BatchControlFlowError("@batch applies to a plain `def` function and must be the "
                                    "decorator nearest to it.")
    definition, filename, offset = _parse(fn)
    definition.decorator_list = []
    definition.body = _Rewriter().statements(definition.body, None)
    code = _compile(definition, fn, filename, offset)
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
    cells[FLOW] = types.CellType(batch_flow)
    rewritten = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                                   tuple(cells[name] for name in code.co_freevars))
    rewritten.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(rewritten, fn)  # type: ignore[return-value]


def _parse(fn: types.FunctionType) -> tuple[ast.FunctionDef, str, int]:
    """The function's ``def`` node, its file, and how far its line numbers must shift."""
    try:
        lines, first = inspect.getsourcelines(fn)
        filename = inspect.getsourcefile(fn) or "<batch>"
    except (OSError, TypeError) as error:
        raise BatchControlFlowError(
            f"@batch needs the source of {fn.__qualname__} ({error}); define it in a file, "
            "not in the interactive interpreter.") from None
    source = "".join(lines)
    indented = source[:1].isspace()  # a method: parse it as the body of an `if`
    tree = ast.parse("if True:\n" + source if indented else source)
    node = tree.body[0].body[0] if indented else tree.body[0]  # type: ignore[attr-defined]
    if not isinstance(node, ast.FunctionDef) or node.name != fn.__name__:
        raise BatchControlFlowError("@batch applies to a `def` function, not a lambda or an "
                                    "async def.")
    return node, filename, first - 1 - indented


def _compile(definition: ast.FunctionDef, fn: types.FunctionType, filename: str,
             offset: int) -> types.CodeType:
    """Compile ``definition`` inside a factory whose parameters are ``fn``'s free variables, so
    the code refers to them as closure cells; a method is compiled inside a class of its
    owner's name, which gives it ``__class__`` and the owner's private-name mangling."""
    owner = _owner(fn.__qualname__)
    params = [name for name in fn.__code__.co_freevars if not (owner and name == "__class__")]
    factory = ast.parse(f"def _batch_factory({', '.join([*params, FLOW])}):\n    pass").body[0]
    outer = ast.parse(f"class {owner}:\n    pass").body[0] if owner else factory
    for node in ast.walk(outer):  # the wrappers sit on the def's own line
        if hasattr(node, "lineno"):
            node.lineno = node.end_lineno = definition.lineno
    factory.body = [definition]  # type: ignore[attr-defined]
    if owner:
        outer.body = [factory]  # type: ignore[attr-defined]
    module = ast.Module(body=[outer], type_ignores=[])
    ast.fix_missing_locations(module)
    ast.increment_lineno(module, offset)
    code = compile(module, filename, "exec", dont_inherit=True)
    return _find(_find(code, "_batch_factory"), fn.__name__)


def _owner(qualname: str) -> str | None:
    """The innermost class around a function, from its qualified name: a part followed by
    ``<locals>`` is a function, any other enclosing part a class."""
    scopes = qualname.split(".")[:-1]
    for index in range(len(scopes) - 1, -1, -1):
        following = scopes[index + 1] if index + 1 < len(scopes) else None
        if scopes[index] != "<locals>" and following != "<locals>":
            return scopes[index]
    return None


def _find(code: types.CodeType, name: str) -> types.CodeType:
    """The code object called ``name`` nested in ``code`` (searched depth first)."""
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            try:
                return _find(const, name)
            except LookupError:
                continue
    raise LookupError(name)


class _Rewriter:
    """Rewrites statements; ``block`` is the name of the innermost enclosing block (None at
    the top of the function)."""

    def __init__(self) -> None:
        self.count = 0

    def statements(self, body: list[ast.stmt], block: str | None) -> list[ast.stmt]:
        return [new for node in body for new in self.statement(node, block)]

    def statement(self, node: ast.stmt, block: str | None) -> list[ast.stmt]:
        if isinstance(node, ast.If):
            return self.branch(node, block)
        if isinstance(node, ast.While | ast.For):
            return self.loop(node, block)
        if isinstance(node, ast.Match):
            if block:
                raise BatchControlFlowError("@batch does not support match inside an "
                                            "if/while/for; use if/elif.")
            for case in node.cases:
                case.body = self.statements(case.body, None)
            return [node]
        if isinstance(node, ast.With | ast.Try | ast.TryStar):
            for field in ("body", "orelse", "finalbody"):
                if hasattr(node, field):
                    setattr(node, field, self.statements(getattr(node, field), block))
            for handler in getattr(node, "handlers", []):
                handler.body = self.statements(handler.body, block)
            return [node]
        if block and isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            return self.assignment(node, block)
        return [node]

    def branch(self, node: ast.If, block: str | None) -> list[ast.stmt]:
        if _jumps([*node.body, *node.orelse]):
            node.test = _call(_flow("plain_condition"), node.test)
            node.body = self.statements(node.body, block)
            node.orelse = self.statements(node.orelse, block)
            return [node]
        test, taken, other = self._names("test", "if", "else")
        out: list[ast.stmt] = [
            _assign(test, _condition(node.test)),
            _assign(taken, _call(_flow("Block"), _parent(block))),
            ast.If(test=_call(_attr(taken, "enter"), _name(test)),
                   body=self.body(node.body, taken), orelse=[]),
        ]
        if node.orelse:
            out += [_assign(other, _call(_flow("Block"), _parent(block))),
                    ast.If(test=_call(_attr(other, "enter_else"), _name(test)),
                           body=self.body(node.orelse, other), orelse=[])]
        return out

    def loop(self, node: ast.While | ast.For, block: str | None) -> list[ast.stmt]:
        kind = "while" if isinstance(node, ast.While) else "for"
        if node.orelse:
            raise BatchControlFlowError(f"@batch does not support {kind} ... else; set a flag "
                                        "in the loop instead.")
        if _jumps(node.body):
            if isinstance(node, ast.While):
                node.test = _call(_flow("plain_condition"), node.test)
            else:
                node.iter = _call(_flow("plain_items"), node.iter)
            node.body = self.statements(node.body, block)
            return [node]
        (loop,) = self._names(kind)
        start = _assign(loop, _call(_flow("Block"), _parent(block)))
        if isinstance(node, ast.While):
            return [start, ast.While(test=_call(_attr(loop, "repeat"), _condition(node.test)),
                                     body=self.body(node.body, loop), orelse=[])]
        step = ast.If(test=_call(_attr(loop, "visit"), _as_load(node.target)),
                      body=self.body(node.body, loop), orelse=[])
        return [start, ast.For(target=node.target, iter=node.iter, body=[step], orelse=[],
                               type_comment=None)]

    def body(self, body: list[ast.stmt], block: str) -> list[ast.stmt]:
        """``body`` rewritten, then each name it assigns settled."""
        settle = [ast.If(test=ast.Compare(left=ast.Constant(name), ops=[ast.In()],
                                          comparators=[_attr(block, "saved")]),
                         body=[_assign(name, _call(_attr(block, "settle"), ast.Constant(name),
                                                   _name(name)))], orelse=[])
                  for name in sorted(_assigned(body))]
        return self.statements(body, block) + settle

    def assignment(self, node: ast.Assign | ast.AugAssign | ast.AnnAssign,
                   block: str) -> list[ast.stmt]:
        text = ast.unparse(node)  # what a refusal quotes
        if isinstance(node, ast.AnnAssign):
            if node.value is None:
                return [node]
            node = ast.Assign(targets=[node.target], value=node.value)
        if isinstance(node, ast.AugAssign):
            if not isinstance(node.target, ast.Name):
                return [_guard(block, text), node]
            name = node.target.id
            value = _call(_attr(block, "augment"), ast.Constant(name), _name(name),
                          ast.Constant(OPERATORS[type(node.op)]), node.value)
            return [_assign(name, value)]
        if len(node.targets) == 1 and not isinstance(node.targets[0], ast.Tuple | ast.List):
            return self.unpack(node.targets[0], node.value, block, text)
        (held,) = self._names("value")  # evaluated once, then given to each target
        out: list[ast.stmt] = [_assign(held, node.value)]
        for target in node.targets:
            out += self.unpack(target, _name(held), block, text)
        return out

    def unpack(self, target: ast.expr, value: ast.expr, block: str,
               text: str) -> list[ast.stmt]:
        """Assign ``value`` to ``target`` (a name, a tuple of them, or anything else); ``text``
        is the statement as written."""
        if isinstance(target, ast.Name):
            return [_assign(target.id, _merged(block, target.id, value))]
        if not isinstance(target, ast.Tuple | ast.List):
            return [_guard(block, text), ast.Assign(targets=[target], value=value)]
        leaves: list[tuple[ast.expr, str]] = []

        def hold(node: ast.expr) -> ast.expr:
            if isinstance(node, ast.Starred):
                return ast.Starred(value=hold(node.value), ctx=ast.Store())
            if isinstance(node, ast.Tuple | ast.List):
                return ast.Tuple(elts=[hold(e) for e in node.elts], ctx=ast.Store())
            (held,) = self._names("value")
            leaves.append((node, held))
            return _name(held, store=True)

        out: list[ast.stmt] = [ast.Assign(targets=[hold(target)], value=value)]
        for leaf, held in leaves:
            out += self.unpack(leaf, _name(held), block, text)
        return out

    def _names(self, *kinds: str) -> list[str]:
        self.count += 1
        return [f"_batch_{kind}{self.count}" for kind in kinds]


def _jumps(nodes: list[ast.AST], in_loop: bool = False) -> bool:
    """Whether ``nodes`` return, yield, or break/continue a loop that encloses them."""
    for node in nodes:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.Return | ast.Yield | ast.YieldFrom):
            return True
        if isinstance(node, ast.Break | ast.Continue) and not in_loop:
            return True
        looped = in_loop or isinstance(node, ast.For | ast.While | ast.AsyncFor)
        if _jumps(list(ast.iter_child_nodes(node)), looped):
            return True
    return False


def _assigned(body: list[ast.stmt]) -> set[str]:
    """Names stored in ``body``, outside nested scopes."""
    names: set[str] = set()
    pending: list[ast.AST] = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
                      | ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        pending.extend(ast.iter_child_nodes(node))
    return names


def _condition(test: ast.expr) -> ast.expr:
    """``and``/``or``/``not`` at the top of a test, as calls that also work per example."""
    if isinstance(test, ast.BoolOp):
        combine = "both" if isinstance(test.op, ast.And) else "either"
        result = _condition(test.values[-1])
        for value in reversed(test.values[:-1]):
            later = ast.Lambda(args=ast.arguments(posonlyargs=[], args=[], kwonlyargs=[],
                                                  kw_defaults=[], defaults=[]), body=result)
            result = _call(_flow(combine), _condition(value), later)
        return result
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _call(_flow("negate"), _condition(test.operand))
    return test


def _merged(block: str, name: str, value: ast.expr) -> ast.expr:
    old = _call(ast.Attribute(value=_call(_name("locals")), attr="get", ctx=ast.Load()),
                ast.Constant(name), _flow("UNBOUND"))
    return _call(_attr(block, "assign"), ast.Constant(name), old, value)


def _guard(block: str, text: str) -> ast.stmt:
    return ast.Expr(_call(_flow("require_plain"), _name(block), ast.Constant(text)))


def _as_load(target: ast.expr) -> ast.expr:
    node = copy.deepcopy(target)
    for child in ast.walk(node):
        if hasattr(child, "ctx"):
            child.ctx = ast.Load()
    return node


def _name(name: str, *, store: bool = False) -> ast.Name:
    return ast.Name(id=name, ctx=ast.Store() if store else ast.Load())


def _attr(owner: str, name: str) -> ast.Attribute:
    return ast.Attribute(value=_name(owner), attr=name, ctx=ast.Load())


def _flow(name: str) -> ast.Attribute:
    return _attr(FLOW, name)


def _call(func: ast.expr, *args: ast.expr) -> ast.Call:
    return ast.Call(func=func, args=list(args), keywords=[])


def _assign(name: str, value: ast.expr) -> ast.Assign:
    return ast.Assign(targets=[_name(name, store=True)], value=value)


def _parent(block: str | None) -> ast.expr:
    return _name(block) if block else ast.Constant(None)
