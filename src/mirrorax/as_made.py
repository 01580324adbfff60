"""Gradients that enter the non-finite guard's branch in the layout the backward pass made them.

A dense kernel's gradient leaves JAX's backward pass as ``transpose(dot(...))`` (the transpose of
``x @ w`` with respect to ``w``; attention's ``einsum`` kernels likewise). In straight-line code XLA never
performs that transpose: the optimizer update reads the gradient transposed inside its own fused loop.
The non-finite guard, though, applies the update inside a ``lax.cond`` branch, and XLA:CPU gives a
branch's operands the default (row-major) layout: the transpose became a copy of every kernel gradient
on every device before the branch. That was 7% of the MLP step at 8 CPU devices in one process, and
most of ``Trainer.fit``'s gap to a hand-written loop on 2 processes.

:func:`split_transposes` traces the gradient function once, hands back each gradient that a final
``transpose`` made as that transpose's input, and a ``restore`` that applies the transposes: called
inside the branch, they fuse into the update again. Everything else the function computes is untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
from jax.extend.core.primitives import convert_element_type_p, transpose_p

__all__ = ["split_transposes"]

PyTree = Any


def split_transposes(fn: Callable[..., tuple[PyTree, ...]], *args: Any, one_device: bool = False
                     ) -> tuple[tuple[PyTree, ...], Callable[[PyTree], PyTree]]:
    """``fn(*args)``, whose first output is a pytree of gradients, with those gradients as made.

    Returns ``(out, restore)``: ``out`` is ``fn(*args)`` except that each leaf of ``out[0]`` that ``fn``
    made with a final ``transpose`` (under mixed precision, followed by casts) is that transpose's input;
    ``restore(out[0])`` gives ``fn``'s own first output. A function with side effects in its trace
    (callbacks) is evaluated as traced, with ``restore`` the identity.

    ``one_device``: the program runs on one device. There a matrix's transpose (a 2-D kernel's gradient)
    stays in ``fn``'s output: XLA folds it into the dot, which then writes the gradient in the layout the
    branch wants, while the same transpose inside the branch reads the matrix column by column in each of
    the update's loops (the MLP's step 25% slower on one CPU device). Across devices an all-reduce stands
    between the dot and the transpose, so nothing folds and every transpose is split.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    first = jax.tree.structure(shapes[0])
    count = 0 if jaxpr.effects else len(jax.tree.leaves(shapes[0]))
    made_by = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}

    def maker(v: Any) -> Any:
        return made_by.get(v) if isinstance(v, jex.Var) else None

    outvars = list(jaxpr.outvars)
    redo: list[tuple[tuple[int, ...], list[Any]] | None] = []  # per gradient: (permutation, casts after it)
    for i in range(count):
        eqn = maker(outvars[i])
        casts: list[Any] = []
        while eqn is not None and eqn.primitive is convert_element_type_p:  # mixed precision: cast(transpose)
            casts.insert(0, eqn.params["new_dtype"])
            eqn = maker(eqn.invars[0])
        folds = one_device and eqn is not None and len(eqn.params.get("permutation", ())) == 2
        if eqn is not None and eqn.primitive is transpose_p and not folds:
            outvars[i] = eqn.invars[0]
            redo.append((tuple(eqn.params["permutation"]), casts))
        else:
            redo.append(None)
    flat = jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr.replace(outvars=outvars), closed.consts))(
        *jax.tree.leaves(args))
    out = jax.tree.unflatten(jax.tree.structure(shapes), flat)

    def restore(grads: PyTree) -> PyTree:
        leaves = jax.tree.leaves(grads)
        for i, how in enumerate(redo):
            if how is not None:
                leaves[i] = jax.lax.transpose(leaves[i], how[0])
                for dtype in how[1]:
                    leaves[i] = jax.lax.convert_element_type(leaves[i], dtype)
        return jax.tree.unflatten(first, leaves)

    return out, restore
