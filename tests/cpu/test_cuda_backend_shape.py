"""The CUDA backend's shape: it composes the portable backend (no inheritance),
defines every op of the Backend protocol itself, and one method of it decides
kernel or portable path and announces the portable one."""

import ast
import inspect
import os

import jax_ep
from jax_ep.backends import cuda
from jax_ep.backends.base import Backend
from jax_ep.backends.xla import XlaBackend

BACKENDS = os.path.join(os.path.dirname(os.path.abspath(jax_ep.__file__)), "backends")
DECIDER = "_kernel_or_portable"


def _protocol_methods() -> list[str]:
  return sorted(name for name, value in vars(Backend).items()
                if inspect.isfunction(value) and not name.startswith("_"))


def _parsed(name: str) -> ast.Module:
  with open(os.path.join(BACKENDS, name), encoding="utf-8") as f:
    return ast.parse(f.read())


def _calls_by_function(tree: ast.Module):
  """(innermost enclosing def, call) of every call in ``tree``; lambdas count as
  part of the def they are written in."""
  def visit(node, function):
    for child in ast.iter_child_nodes(node):
      inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
      if isinstance(child, ast.Call):
        yield inner, child
      yield from visit(child, inner)
  yield from visit(tree, None)


def _callee(call: ast.Call) -> str:
  return ast.unparse(call.func)


def test_cuda_backend_composes_the_portable_backend():
  assert not issubclass(cuda.CudaBackend, XlaBackend)
  backend = cuda.CudaBackend()
  assert isinstance(backend.portable, XlaBackend) and backend.name == "cuda"
  other = XlaBackend()
  assert cuda.CudaBackend(portable=other).portable is other


def test_cuda_backend_defines_every_protocol_method_itself():
  methods = _protocol_methods()
  assert "ht_dispatch" in methods and "ll_combine_recv" in methods and "layout" in methods
  missing = [m for m in methods if not inspect.isfunction(vars(cuda.CudaBackend).get(m))]
  assert missing == []
  for name in methods:  # same parameters, in the same order
    ours = list(inspect.signature(getattr(cuda.CudaBackend, name)).parameters)
    assert ours == list(inspect.signature(getattr(Backend, name)).parameters), name


def test_portable_fallback_is_called_from_one_function():
  callers = sorted({(name, function)
                    for name in os.listdir(BACKENDS) if name.endswith(".py")
                    for function, call in _calls_by_function(_parsed(name))
                    if _callee(call).split(".")[-1] == "portable_fallback"})
  assert callers == [("cuda.py", DECIDER)]


def test_every_kernel_op_goes_through_the_one_decision():
  """Each protocol op but layout (no kernel) calls _kernel_or_portable, and the
  portable backend's ops are called only from the portable argument of that
  call, or from layout."""
  tree = _parsed("cuda.py")
  (backend_class,) = [n for n in tree.body
                      if isinstance(n, ast.ClassDef) and n.name == "CudaBackend"]
  methods = {n.name: n for n in backend_class.body if isinstance(n, ast.FunctionDef)}
  for name in _protocol_methods():
    callees = {_callee(n) for n in ast.walk(methods[name]) if isinstance(n, ast.Call)}
    if name == "layout":
      assert callees == {"self.portable.layout"}, callees
    else:
      assert f"self.{DECIDER}" in callees, name
  allowed = set()  # the calls inside each decision's portable argument (its 5th)
  for call in ast.walk(backend_class):
    if isinstance(call, ast.Call) and _callee(call) == f"self.{DECIDER}":
      portable = call.args[4]
      assert isinstance(portable, ast.Lambda), ast.unparse(call)
      allowed |= {id(n) for n in ast.walk(portable)}
  allowed |= {id(n) for n in ast.walk(methods["layout"])}
  stray = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call)
           and _callee(n).startswith("self.portable.") and id(n) not in allowed]
  assert stray == []
